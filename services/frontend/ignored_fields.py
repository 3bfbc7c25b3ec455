"""Request fields the server does not know: ignored (OpenAI clients send extras), but
said so: each name is logged once per process, and a response lists the ones its
request carried in the `x-kvflow-ignored-fields` header (comma-separated)."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from starlette.responses import Response

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-kvflow-ignored-fields"
_MAX_WARNED = 1024  # distinct names logged; a client cannot grow the set without bound
_HEADER_SAFE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # names fit for a header value

_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_FIELDS: dict[type, frozenset[str]] = {}
_warned: set[str] = set()


def ignored_fields(body: bytes, request_type: type[Any]) -> list[str]:
    """Top-level keys of a (decoded, hence valid) JSON body that `request_type` lacks;
    the first time a name is seen it is logged as a warning."""
    known = _FIELDS.get(request_type)
    if known is None:
        fields = msgspec.structs.fields(request_type)
        known = _FIELDS[request_type] = frozenset(f.encode_name for f in fields)
    ignored = sorted(key for key in _KEYS.decode(body) if key not in known)
    for name in ignored:
        if name not in _warned and len(_warned) < _MAX_WARNED:
            _warned.add(name)
            logger.warning("request field %r is not supported and is ignored", name)
    return ignored


def mark_ignored(response: Response, ignored: list[str]) -> Response:
    """`response` with the header naming the ignored fields (those a header can carry)."""
    names = [name for name in ignored if _HEADER_SAFE.fullmatch(name)]
    if names:
        response.headers[IGNORED_FIELDS_HEADER] = ",".join(names)
    return response
