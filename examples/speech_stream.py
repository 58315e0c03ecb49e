"""Speak text while it is being written: `drama3-serve`'s WebSocket route, fed word by word as an LLM would.

    python examples/speech_stream.py                                # starts a tiny server in this process
    python examples/speech_stream.py --url http://127.0.0.1:8000 --api-key KEY    # a running drama3-serve
    python examples/speech_stream.py --format opus                  # each utterance as an Ogg Opus file

Needs `pip install "transformers-drama3[serve]" websockets`. Without `--url` a server on the embedded tiny random
checkpoint runs in a background thread (`ServerThread`); it speaks noise. Each utterance's audio goes to
`utterance-N.FORMAT` (16-bit PCM by default; `--format opus`, `mp3` or `aac`: a complete file per utterance).
docs/serving.md ("Streaming text in over a WebSocket") describes the protocol.
"""

import contextlib
import json
import time

from websockets.sync.client import connect

from example_setup import server_parser, server_url


def main() -> None:
    parser = server_parser(__doc__)
    parser.add_argument("--text", default="Hello there. I am reading this while it is written. Nice, isn't it?")
    parser.add_argument("--format", default="pcm", choices=["pcm", "opus", "mp3", "aac"], help="the session's audio")
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        url = server_url(stack, args)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        with connect(url.replace("http", "ws", 1) + "/v1/audio/speech/stream", additional_headers=headers) as socket:
            socket.send(json.dumps({"type": "session.start", "model": args.model, "seed": 0, "max_new_tokens": 48,
                                    "response_format": args.format}))
            print(json.loads(socket.recv()))
            start = time.perf_counter()
            for word in args.text.split(" "):  # the tokens of an LLM, as they come
                socket.send(json.dumps({"type": "text.append", "text": word + " "}))
            socket.send(json.dumps({"type": "text.done"}))
            out = None
            for message in socket:  # ends when the server closes the session
                if isinstance(message, bytes):
                    out.write(message)
                    continue
                event = json.loads(message)
                if event["type"] == "utterance.started":
                    out = stack.enter_context(open(f"utterance-{event['index']}.{args.format}", "wb"))
                    print(f"{time.perf_counter() - start:5.2f} s  speaking {event['text']!r}")
                elif event["type"] == "utterance.done":
                    print(f"{time.perf_counter() - start:5.2f} s  done: {event['frames']} frames -> "
                          f"utterance-{event['index']}.{args.format}")
                elif event["type"] == "error" and event["error"]["code"] == "draining":  # SIGTERM: a replica stops
                    print(f"the server is shutting down; text to send to another replica: {event['unspoken_text']!r}")
                else:
                    print(event)


if __name__ == "__main__":
    main()
