"""One chat completion request for tests that need an answer, not a client."""

from mlxgw.httpget import post


def ask(url, text, **kw):
    """POST ``text`` as one user message to ``url``'s /v1/chat/completions (model demo-tiny,
    3 tokens unless ``kw`` says otherwise); (status, headers, body bytes), never raising on a 4xx/5xx."""
    return post(url + "/v1/chat/completions",
                {"model": "demo-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3, **kw})
