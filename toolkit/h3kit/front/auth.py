"""Bearer tokens from a file, each naming a user.

The file has one `USER TOKEN` pair a line (blank lines and `#` comments ignored); a token is at least 16
characters, a user name is letters, digits and `._@-`. The file must not be readable by other users of the host
(chmod 600), as ssh asks of its keys. A request carries `Authorization: Bearer TOKEN`; a browser, which cannot
add that header to the ComfyUI page's own requests, opens the page once as `/?token=TOKEN`: the front then sets
a cookie (HttpOnly, SameSite=Strict) that later requests and /ws carry.

Without a tokens file every request is user "local", and the front only binds a loopback address.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import stat
from pathlib import Path

from h3kit.front import FrontUsageError

COOKIE = "h3front_token"
LOCAL_USER = "local"
_USER = re.compile(r"^[A-Za-z0-9._@-]{1,128}$")
MIN_TOKEN = 16


def load_tokens(path: str | os.PathLike) -> dict[str, str]:
    """{token: user} from the file; FrontUsageError naming the line for anything malformed."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except OSError as e:
        raise FrontUsageError(f"cannot read the tokens file {p}: {e.strerror or e}",
                              hint="give --tokens a readable file of `USER TOKEN` lines") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise FrontUsageError(f"the tokens file {p} is readable or writable by other users",
                              hint=f"chmod 600 {p}")
    tokens: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not _USER.match(parts[0]) or len(parts[1]) < MIN_TOKEN:
            raise FrontUsageError(f"{p}, line {n}: expected `USER TOKEN` (a user name of letters, digits and ._@-, "
                                  f"a token of at least {MIN_TOKEN} characters)",
                                  hint="make a token with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        if parts[1] in tokens:
            raise FrontUsageError(f"{p}, line {n}: this token is already given to user {tokens[parts[1]]!r}",
                                  hint="give every user a token of their own")
        tokens[parts[1]] = parts[0]
    if not tokens:
        raise FrontUsageError(f"the tokens file {p} names no user", hint="add a `USER TOKEN` line")
    return tokens


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tokens: dict | None) -> None:
    if not tokens and not is_loopback(host):
        raise FrontUsageError(f"refusing to listen on {host} without tokens: anyone who reaches it could queue "
                              "work on your servers",
                              hint="pass --tokens FILE (lines `USER TOKEN`, chmod 600), or listen on 127.0.0.1 "
                                   "behind a reverse proxy that authenticates (docs/service.md, 'h3kit front')")


def user_of(headers, cookies, query, tokens: dict | None) -> str | None:
    """The user a request authenticates as, or None. Without tokens: LOCAL_USER."""
    if not tokens:
        return LOCAL_USER
    given = None
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    given = given or cookies.get(COOKIE) or query.get("token")
    if not given:
        return None
    for token, user in tokens.items():
        if hmac.compare_digest(token.encode(), given.encode()):
            return user
    return None
