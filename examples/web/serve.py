"""Serve the prepared page (examples/web/site/) on localhost.

    python examples/web/serve.py [--port 8000] [--isolate] [DIRECTORY]

Python's http.server with the MIME types the page needs (``.mjs`` as JavaScript, ``.wasm`` as
``application/wasm``) and no caching. ``--isolate`` adds the cross-origin isolation headers
(COOP/COEP) under which onnxruntime-web may use wasm threads; without them it runs
single-threaded. ``--port 0`` picks a free port. The first line printed is the page's URL.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import pathlib
import sys

SITE = pathlib.Path(__file__).resolve().parent / "site"


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
                      ".json": "application/json", ".onnx": "application/octet-stream", "": "application/octet-stream"}
    isolate = False

    def end_headers(self):
        self.send_header("Cache-Control", "no-store")
        if self.isolate:
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_request(self, code="-", size="-"):  # quiet: only failed requests are logged
        if str(getattr(code, "value", code)).startswith(("4", "5")):
            super().log_request(code, size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=str(SITE))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--isolate", action="store_true", help="send COOP/COEP headers (wasm threads)")
    args = parser.parse_args(argv)
    directory = pathlib.Path(args.directory)
    if not (directory / "index.html").exists():
        sys.exit(f"{directory} has no index.html: run `python examples/web/prepare.py` first")
    handler = functools.partial(type("SiteHandler", (Handler,), {"isolate": args.isolate}), directory=str(directory))
    with http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler) as server:
        print(f"http://127.0.0.1:{server.server_address[1]}/", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
