"""Chat with the embedded SmolLM2-135M-Instruct on kvdoctor's engine, tokens streamed as they come.

Each turn sends the whole conversation through the chat template as one request,
so a trace of a session shows one sequence per turn. Type a message and press
Enter; an empty line or Ctrl-D ends the chat::

    .venv/bin/python examples/chat.py --trace chat.kvtrace
    .venv/bin/python examples/chat.py --prompt "Tell me a joke."     # one turn, then exit
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Chat with a model running on kvdoctor's engine.")
    ap.add_argument("--model", help="a local checkpoint directory (default: the embedded SmolLM2)")
    ap.add_argument("--prompt", help="answer this one message and exit")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--device-blocks", type=int, default=128)
    ap.add_argument("--host-blocks", type=int, default=512)
    ap.add_argument("--trace", help="write the engine's events to this trace file")
    args = ap.parse_args(argv)

    from kvdoctor.engine.model.model import load_model
    from kvdoctor.engine.serving.runner import Runner, SamplingParams
    from kvdoctor.engine.serving.scheduler import Request, Scheduler
    from kvdoctor.trace import TraceWriter

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    runner = Runner.create(loaded.model, tokenizer=tok, device_blocks=args.device_blocks,
                           host_blocks=args.host_blocks, extra={"model": loaded.name})
    writer = None
    if args.trace:
        writer = TraceWriter(args.trace, runner.cache.header())
        runner.bus.subscribe(writer.write_many)
    sampling = SamplingParams(greedy=args.greedy, temperature=0.7, top_p=0.9, seed=0)
    messages: list[dict[str, str]] = []
    streamed: list[int] = []

    def on_token(seq: object, token: int) -> None:
        # Decode the whole reply each time: a token may end in the middle of a character.
        before = tok.decode(streamed, skip_special_tokens=True)
        streamed.append(token)
        after = tok.decode(streamed, skip_special_tokens=True)
        print(after[len(before):], end="", flush=True)

    sched = Scheduler(runner, on_token=on_token)  # one for the session, so sequence ids stay unique in the trace
    try:
        while True:
            if args.prompt is not None:
                text = args.prompt if not messages else ""
            else:
                try:
                    text = input("you> ").strip()
                except EOFError:
                    text = ""
            if not text:
                break
            messages.append({"role": "user", "content": text})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            streamed.clear()
            print("bot> ", end="", flush=True)
            seq = sched.submit(Request(ids, max_new_tokens=args.max_new_tokens, sampling=sampling))
            reply = sched.run()[seq]
            print()
            messages.append({"role": "assistant", "content": reply.text or ""})
    finally:
        runner.close()
        if writer is not None:
            writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
