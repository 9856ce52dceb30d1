"""Query a running spec_engine server with the official `openai` client (pip install openai).

    python -m spec_engine.launch_server --model-path DIR --port 30000    # in another shell
    python examples/serve/openai_client.py --base-url http://127.0.0.1:30000/v1

Any code written for an OpenAI-compatible endpoint (SGLang, vLLM) works unchanged.
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    # The server takes any key unless it was started with --api-key.
    client = openai.OpenAI(base_url=args.base_url, api_key="unused")
    # The server answers for any model name; /v1/models reports the one it serves.
    model = client.models.list().data[0].id

    completion = client.completions.create(
        model=model, prompt="The cat", max_tokens=args.max_tokens, temperature=0
    )
    print(f"completion: {completion.choices[0].text!r}")

    messages = [{"role": "user", "content": "What is two plus two?"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=args.max_tokens, temperature=0
    )
    print(f"chat: {chat.choices[0].message.content!r}")

    # Streaming sends the text in deltas as it is generated; greedy, so it equals the chat above.
    pieces = []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    print(f"stream: {''.join(pieces)!r}")


if __name__ == "__main__":
    main()
