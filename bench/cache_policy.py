"""Prefill work of our backend's prompt cache vs ``mlx_lm.server``'s, and the floor.

A scripted agent workload (cache-policy issue, acceptance 3): ``--sessions``
sessions x ``--turns`` turns sharing one ``--system-tokens`` system prompt,
sessions interleaved turn by turn (so they compete for the cache), with

* turn 1 a tool-call turn: the request carries ``tools``; the client then
  appends an assistant ``tool_calls`` message and a tool result (the demo
  model's random weights cannot choose a tool, so the call is the client's;
  the cache sees the same token sequence a real tool-call-only turn leaves),
* turn 2 a text stop sequence (``stop`` reached after 3 tokens),
* turn 3 a client disconnect after the first streamed token (the reply is
  lost; the next turn continues without it),
* the other turns plain ``max_tokens`` answers.

The same script runs against one of our backends and one ``mlx_lm.server``
(same model, same cache byte budget and entry count), one after the other,
for each budget. Prefill tokens computed: ours from the backend's own
counter (``/health`` ``prefill_tokens``), mlx_lm.server's from its log
(``Prompt processing progress: n/n``, one line per request). The floor is
the number of distinct prefixes over all prompts sent (a token trie): what an
infinite cache would still have to compute.

    python bench/cache_policy.py --out bench/results/cache-policy.json
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import revision  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from mlxgw import httpget  # noqa: E402
from mlxgw.harness import LOG_DIR, Proc, RedisServer, free_port  # noqa: E402
from mlxgw.util import parse_bytes  # noqa: E402
from texts import words  # noqa: E402

THE = 269  # " the" in the demo tokenizer
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
PROGRESS = re.compile(r"Prompt processing progress: (\d+)/(\d+)")


def system_prompt(tok, target: int) -> str:
    """A system prompt of about ``target`` tokens (rendered alone)."""
    from mlxgw.prompt import render_chat

    n = target // 2
    while True:
        text = words(n, seed=5)
        got = render_chat(tok, [{"role": "system", "content": text}, {"role": "user", "content": "x"}]).system_tokens
        if got >= target:
            return text
        n += max(1, (target - got) // 2)


def post_chat(url: str, body: dict) -> dict:
    status, _, raw = httpget.post(url + "/v1/chat/completions", body, timeout=600)
    if status != 200:
        raise RuntimeError(f"{url}: {status} {raw[:300]!r}")
    return json.loads(raw)


def disconnect_after_first_token(port: int, body: dict) -> None:
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        buf = b""
        while b"data: {" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk


def wait_idle_ours(url: str) -> None:
    for _ in range(600):
        if (httpget.get_json(url + "/health") or {}).get("active") == 0:
            return
        time.sleep(0.05)


def prefill_so_far(url: str, ours: bool, log_path: Optional[Path]) -> int:
    """Prefill tokens the server computed up to now (ours: its counter; mlx_lm.server: its log)."""
    if ours:
        wait_idle_ours(url)
        return httpget.get_json(url + "/health")["prefill_tokens"]
    time.sleep(0.2)  # let the server finish logging the request
    return sum(int(b) for a, b in PROGRESS.findall(log_path.read_text(errors="replace")) if a == b)


def run_script(url: str, port: int, tok, args, system: str, ours: bool, model_field: str,
               log_path: Optional[Path] = None) -> dict:
    """Send the whole workload; return the prompts sent (token ids), usage seen and
    the prefill tokens each request cost."""
    from mlxgw.prompt import render_chat

    hist = [[{"role": "system", "content": system}] for _ in range(args.sessions)]
    prompts, usage, per_request = [], [], []
    done = 0
    for t in range(args.turns):
        for s in range(args.sessions):
            h = hist[s]
            h.append({"role": "user", "content": words(60 + 10 * t, seed=1000 * s + t)})
            body = {"model": model_field, "messages": h, "max_tokens": 8, "temperature": 0}
            kind = {1: "tool", 2: "stop", 3: "disconnect"}.get(t, "plain")
            if kind in ("tool", "plain") and t >= 1:
                body["tools"] = TOOLS
            if kind == "stop":
                body.update(logit_bias={str(THE): 100}, stop=[" the the"], max_tokens=30)
            prompts.append(render_chat(tok, h, body.get("tools")).token_ids)
            if kind == "disconnect":
                disconnect_after_first_token(port, {**body, "max_tokens": 1000})
                time.sleep(0.3)
                now = prefill_so_far(url, ours, log_path)
                per_request.append({"session": s, "turn": t, "kind": kind, "prompt": len(prompts[-1]),
                                    "prefill": now - done})
                done = now
                continue
            out = post_chat(url, body)
            now = prefill_so_far(url, ours, log_path)
            per_request.append({"session": s, "turn": t, "kind": kind, "prompt": len(prompts[-1]),
                                "prefill": now - done})
            done = now
            usage.append(out["usage"])
            reply = out["choices"][0]["message"].get("content") or ""
            if kind == "tool":
                h.append({"role": "assistant", "content": reply, "tool_calls": [{
                    "id": f"call_{s}_{t}", "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/mod{s}.py"})}}]})
                h.append({"role": "tool", "tool_call_id": f"call_{s}_{t}", "content": words(150, seed=77 * s + t)})
            else:
                h.append({"role": "assistant", "content": reply})
    return {"prompts": prompts, "usage": usage, "per_request": per_request}


def floor_tokens(prompts: list[list[int]]) -> int:
    """Distinct prefixes over all prompts (trie nodes): tokens no cache could have saved."""
    root: dict = {}
    n = 0
    for p in prompts:
        node = root
        for t in p:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                n += 1
            node = nxt
    return n


def run_ours(model: str, budget: int, entries: int, tok, args, system: str, tag: str) -> dict:
    redis_srv = RedisServer().start()
    port = free_port()
    cmd = [sys.executable, "-m", "mlxgw", "backend", "--model", model, "--served-name", "demo", "--port", str(port),
           "--id", "ours", "--redis-url", redis_srv.url, "--cache-bytes", str(budget), "--cache-entries", str(entries)]
    p = Proc("ours", cmd, port, LOG_DIR / f"bench-cache-{tag}-ours.log").start(_env())
    try:
        p.wait_healthy()
        res = run_script(p.url, port, tok, args, system, ours=True, model_field="demo")
        wait_idle_ours(p.url)
        h = httpget.get_json(p.url + "/health")
        res["prefill"] = h["prefill_tokens"]
        res["prompt_total"] = h["prompt_tokens"]
        return res
    finally:
        p.stop()
        redis_srv.cleanup()


def run_mlx_lm(model: str, budget: int, entries: int, tok, args, system: str, tag: str) -> dict:
    port = free_port()
    log_path = LOG_DIR / f"bench-cache-{tag}-mlx_lm.log"
    log_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port), "--log-level", "INFO",
           "--prompt-cache-bytes", str(budget), "--prompt-cache-size", str(entries), "--max-tokens", "8"]
    p = Proc("mlx_lm", cmd, port, log_path).start(_env())
    try:
        p.wait_healthy()
        res = run_script(p.url, port, tok, args, system, ours=False, model_field=model, log_path=log_path)
        time.sleep(1.0)
    finally:
        p.stop()
    finals = [int(b) for a, b in PROGRESS.findall(log_path.read_text(errors="replace")) if a == b]
    res["prefill"] = sum(finals)
    res["requests_logged"] = len(finals)
    return res


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model dir (default: the tiny demo model, built offline)")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--budgets", default="4MB,8MB,16MB,64MB", help="cache byte budgets, comma-separated")
    ap.add_argument("--entries", type=int, default=32, help="cache entry limit (both servers)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    from gateway.tokenize import load_model_info
    from mlxgw.demo_model import ensure_demo_model

    model = args.model or str(ensure_demo_model("tiny"))
    tok = load_model_info("demo", model).tokenizer
    system = system_prompt(tok, args.system_tokens)
    cmd = "python bench/cache_policy.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(f"# {cmd} (commit {revision()})")
    print(f"model {model}; {args.sessions} sessions x {args.turns} turns; entries {args.entries}")
    rows = []
    for b in [x.strip() for x in args.budgets.split(",") if x.strip()]:
        budget = parse_bytes(b)
        ours = run_ours(model, budget, args.entries, tok, args, system, b)
        mlx = run_mlx_lm(model, budget, args.entries, tok, args, system, b)
        floor = floor_tokens(ours["prompts"])
        same_prompts = [u["prompt_tokens"] for u in ours["usage"]] == [u["prompt_tokens"] for u in mlx["usage"]]
        row = {
            "budget": b, "budget_bytes": budget, "requests": len(ours["prompts"]),
            "prompt_tokens": sum(len(p) for p in ours["prompts"]), "floor": floor,
            "ours": ours["prefill"], "mlx_lm_server": mlx["prefill"],
            "ours_vs_floor": round(ours["prefill"] / floor, 4),
            "mlx_lm_server_vs_floor": round(mlx["prefill"] / floor, 4),
            "mlx_lm_requests_logged": mlx["requests_logged"], "same_prompt_lengths": same_prompts,
        }
        row["per_request"] = [{**a, "mlx_lm_prefill": b["prefill"]} for a, b in
                              zip(ours["per_request"], mlx["per_request"])]
        rows.append(row)
        print(f"budget {b:>6}: prompt {row['prompt_tokens']:>7}  floor {floor:>6}  ours {row['ours']:>7} "
              f"({row['ours_vs_floor']:.3f}x floor)  mlx_lm.server {row['mlx_lm_server']:>7} "
              f"({row['mlx_lm_server_vs_floor']:.3f}x floor)  [mlx_lm log lines {mlx['requests_logged']}, "
              f"same prompts {same_prompts}]", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": cmd, "commit": revision(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    raise SystemExit(main())
