"""Launch the HTTP server: `python -m spec_engine.launch_server --model-path DIR [engine flags]`.

With --nnodes > 1 every node runs this; node 0 serves, a node with --node-rank > 0 runs its ranks
(engine.serve_node) and exits when rank 0 stops the engine."""

from __future__ import annotations

import argparse
import logging
import sys

from spec_engine.args.dataclass_cli import HelpFormatter
from spec_engine.args.engine_args import add_cli_args, from_cli_args
from spec_engine.engine import Engine, serve_node
from spec_engine.server.http_server import create_app

logger = logging.getLogger("spec_engine.launch_server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spec_engine.launch_server",
        usage="%(prog)s --model-path DIR [engine flags]",
        formatter_class=HelpFormatter,
        description="Serve a model over SGLang-native and OpenAI-compatible HTTP APIs.",
    )
    # EngineArgs leaves model_path unset for in-process engines built from keyword arguments;
    # a server has nothing to serve without it.
    add_cli_args(parser, required=["model_path"])
    return parser


def main(argv: list[str] | None = None) -> None:
    args = from_cli_args(build_parser().parse_args(argv))
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    if args.node_rank > 0:  # SGLang's node_rank >= 1: this node's ranks only, no HTTP
        serve_node(args)
        return
    engine = Engine(args)
    if not engine.args.skip_server_warmup:
        engine.generate(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    import uvicorn  # only to serve: parsing and --help work without it

    app = create_app(engine)
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
