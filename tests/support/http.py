"""One HTTP client for the tests' own requests to the servers they start.

`httpx.get(...)` builds a client, and with it an SSL context that loads the CA certificates,
on every call: about 30 ms each, which the suite's polling loops paid thousands of times. One
client serves every test (httpx's clients are safe across threads); it keeps no connection
alive, so a server stopped and another started on the same port never meets a stale one.
"""

from __future__ import annotations

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
