"""What the server and the library's own client (engine/remote/) agree on, in one place: the frame
content type, the error field that names the engine's exception class, the protocol version and the
routes the client calls. Imports nothing heavy, so a client imports it without the server's stack.

Tensors in a frame (engine/serve/encoding.py: `frame_bytes` / `unframe`) travel as raw bytes; in JSON
they are base64. A client asks for frames with `Accept: FRAME_TYPE`; an error is always JSON."""
from __future__ import annotations

PROTOCOL = 1  # bumped when a route or a field the client reads changes meaning
FRAME_TYPE = "application/x-interp-frame"
ERROR_CLASS = "engine_error"  # the error body's field: the engine's exception class name, or null

CAPABILITIES = "/v1/capabilities"
CAPTURE = "/v1/capture"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/v1/tokenize"
DETOKENIZE = "/v1/detokenize"
LENS = "/v1/lens"
