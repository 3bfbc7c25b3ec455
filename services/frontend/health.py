"""`/health` while some, not all, engines serve (data parallelism).

    200, empty body                 every engine serves
    200, {"status": "degraded",     at least one engine serves; requests go to those
          "engines": {"0": "ok", "1": "<why not>"}}
    503, OpenAI error shape         no engine serves

A load balancer keeps sending traffic on 200 (the server still answers), and a human or
a probe that reads the body sees which engine is down and why.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from starlette.responses import Response


def degraded_health(problems: dict[str, str | None]) -> Response:
    engines = {label: problem or "ok" for label, problem in problems.items()}
    body = json.dumps({"status": "degraded", "engines": engines})
    return Response(body, status_code=HTTPStatus.OK, media_type="application/json")
