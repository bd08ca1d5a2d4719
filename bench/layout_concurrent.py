"""The two cache layouts (docs/cache-policy.md, rule 7) on real demo-model backends under a tight
budget and concurrent turns: the shape of helper-44's trial in session 29.

One backend per layout (`--cache-layout shared` / `whole`, same budget, `--min-shared-tokens 64`),
fresh for each seed; 8 conversations over 2 long system prompts, 4 rounds, branches of 3 of them
and a regeneration, each round's requests shuffled and sent 6 at a time to each backend (both
backends get the same requests at once). Prints, per seed, the cached_tokens each layout served,
and whether their greedy answers were identical; the last line is the JSON of all seeds.

    python bench/layout_concurrent.py --budget 3MB --seeds 3,4,5,6,7,8,9,10,11,12,13,14,15
    python bench/layout_concurrent.py --budget 2MB --backend-flags='--no-prefill-save-pin'
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from openai import OpenAI  # noqa: E402

from mlxgw.demo_model import ensure_demo_model  # noqa: E402
from mlxgw.harness import RedisServer, Stack  # noqa: E402


def system_prompt(k: int, n: int) -> str:
    return f"System {k}. " + " ".join(
        f"Guideline {k}-{i}: inspect component_{k}_{i} for defect class {i * 13 + k}." for i in range(n))


def one_seed(demo: str, budget: str, seed: int, extra: list[str]) -> dict:
    redis = RedisServer().start()
    s = Stack(redis.url, demo)
    try:
        flags = ["--cache-bytes", budget, "--min-shared-tokens", "64", *extra]
        bs = {lay: s.add_backend(lay, None, *flags, "--cache-layout", lay) for lay in ("shared", "whole")}
        for b in bs.values():
            b.wait_healthy()
        clients = {lay: OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0, timeout=300) for lay, b in bs.items()}
        cached = {lay: 0 for lay in bs}
        prompt = {lay: 0 for lay in bs}
        texts: dict = {lay: {} for lay in bs}

        def ask(lay, tag, msgs):
            r = clients[lay].chat.completions.create(model=s.model_name, messages=msgs, max_tokens=10, temperature=0)
            cached[lay] += r.usage.prompt_tokens_details.cached_tokens
            prompt[lay] += r.usage.prompt_tokens
            texts[lay][tag] = r.choices[0].message.content

        systems = [system_prompt(0, 50), system_prompt(1, 45)]
        convs = {k: [{"role": "system", "content": systems[k % 2]}] for k in range(8)}
        rng = random.Random(seed)
        for rnd in range(4):
            jobs = []
            for k in range(8):
                convs[k].append({"role": "user", "content": f"conv {k} round {rnd} item {rng.randint(0, 999)}"})
                jobs.append((f"c{k}.r{rnd}", list(convs[k])))
                if rnd >= 1 and k < 3:
                    jobs.append((f"c{k}.r{rnd}.branch", convs[k][:-1] + [{"role": "user", "content": f"branch {k} {rnd}"}]))
                if rnd >= 2 and k == 4:
                    jobs.append((f"c{k}.r{rnd - 1}.regen", convs[k][:-1]))
            rng.shuffle(jobs)
            with ThreadPoolExecutor(12) as ex:  # 6 in flight per backend
                list(ex.map(lambda a: ask(*a), [(lay, t, m) for t, m in jobs for lay in bs]))
            for k in range(8):
                convs[k].append({"role": "assistant", "content": texts["shared"][f"c{k}.r{rnd}"]})
        same = sum(texts["shared"][t] == texts["whole"][t] for t in texts["shared"])
        return {"cached": cached, "prompt": prompt["shared"], "requests": len(texts["shared"]), "same_answers": same}
    finally:
        s.stop()
        redis.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="3MB", help="cache budget per backend (binary units)")
    p.add_argument("--seeds", default="3,4,5", help="comma-separated seeds (one pair of fresh backends each)")
    p.add_argument("--model", default=None, help="model dir (default: the demo model)")
    p.add_argument("--backend-flags", default="", help="more flags for both backends, one string "
                   "(e.g. '--no-prefill-save-pin')")
    args = p.parse_args()
    demo = args.model or str(ensure_demo_model("tiny"))
    out = {}
    for seed in (int(x) for x in args.seeds.split(",")):
        r = out[seed] = one_seed(demo, args.budget, seed, args.backend_flags.split())
        print(f"seed {seed}: cached tokens shared {r['cached']['shared']}, whole {r['cached']['whole']} of "
              f"{r['prompt']}; identical answers {r['same_answers']}/{r['requests']}", flush=True)
    sh = sum(r["cached"]["shared"] for r in out.values())
    wh = sum(r["cached"]["whole"] for r in out.values())
    wins = sum(r["cached"]["shared"] > r["cached"]["whole"] for r in out.values())
    print(f"budget {args.budget}: shared / whole cached tokens {sh} / {wh} = {sh / wh:.3f}; shared ahead in {wins} "
          f"of {len(out)} seeds")
    print(json.dumps(out))


if __name__ == "__main__":
    from mlxgw.harness import exit_on_sigterm

    exit_on_sigterm()
    main()
