"""One HTTP request from inside a test host: `python client.py METHOD URL [BODY]`.

Run under `ip netns exec`, so the request leaves from that namespace. The
bearer token comes from $RLX_CLUSTER_TOKEN (unset: no Authorization header).
Prints {"status": ..., "body": ...} as one JSON line; the body is parsed JSON
when it is JSON, else text; status 0 when no HTTP answer came (the reason in
body). Standard library only: it runs with `python -I`.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 15.0


def main() -> None:
    method, url, *rest = sys.argv[1:]
    data = rest[0].encode() if rest else None
    req = urllib.request.Request(url, data=data, method=method)
    token = os.environ.get("RLX_CLUSTER_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            status, raw, kind = resp.status, resp.read(), resp.headers.get_content_type()
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read(), exc.headers.get_content_type()
    except OSError as exc:  # refused, unreachable, timed out: status 0 says no HTTP answer came
        print(json.dumps({"status": 0, "body": f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"}))
        return
    body = json.loads(raw) if kind == "application/json" else raw.decode(errors="replace")
    print(json.dumps({"status": status, "body": body}))


if __name__ == "__main__":
    main()
