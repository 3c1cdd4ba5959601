"""Who a request's user is, and per-user quotas on what is in flight (issue #21, point 1).

**Users.** With several API keys (``--api-key`` repeated, or ``--api-key-file``: one key per
line, ``name:key`` to name it) each key is a user: a named key's user is its name, an unnamed
one's ``key-`` and the first 8 hex digits of its SHA-256 (stable, not the secret). The
request's OpenAI ``user`` field is then ignored (a key holder cannot pass as another key's user,
nor split itself into many users to get around a quota). With one unnamed key or none, the user
is the ``user`` field; requests without one are one anonymous user (as for the scheduler's fair
share, :mod:`kvserve.core.scheduler`).

**Quotas** (:class:`UserQuotas`). ``max_requests``: HTTP requests of one user in flight (a
batch of prompts is one request). ``max_tokens``: the sum, over a user's requests in flight, of
their prompt tokens plus ``max_tokens`` (else what is left of the context) times the sequences
they sample (``n``, ``best_of`` or the beam width). A request over a quota gets 429 with
``Retry-After`` and a message naming the limit; one that alone needs more tokens than
``max_tokens`` gets 400 (no wait would help). The counts are charged at submission and released
when the request ends however it ends (finished, failed, timed out, its client gone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

from kvserve.entrypoints.openai.protocol import APIError

#: ``Retry-After`` (seconds) of a 429: requests of a few hundred tokens end within about that
RETRY_AFTER_S = 1

ApiKeys = Union[None, str, Sequence[str], Mapping[str, Optional[str]]]


def key_user_name(key: str) -> str:
    """The user name of an unnamed key among several: not the key, but stable across restarts."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def read_api_key_file(path: str | Path) -> dict[str, Optional[str]]:
    """``--api-key-file``: key → user name (None: unnamed); one key per line, ``name:key`` names
    it; blank lines and lines starting with ``#`` are skipped.

    Raises:
        ValueError: the file cannot be read, a line is malformed, or a key or name repeats.
    """
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"--api-key-file: cannot read {str(path)!r}: {e.strerror or e}") from None
    keys: dict[str, Optional[str]] = {}
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        name, key = (name.strip(), key.strip()) if sep else (None, line)
        if not key or (sep and not name) or any(c.isspace() for c in key):
            raise ValueError(f"--api-key-file {path}, line {i}: expected 'KEY' or 'NAME:KEY' (no spaces in the key)")
        if key in keys:
            raise ValueError(f"--api-key-file {path}, line {i}: the key repeats an earlier one")
        keys[key] = name
    return keys


def api_key_users(keys: ApiKeys) -> dict[str, Optional[str]]:
    """key → its user name (None: the request's ``user`` field names the user), from one key,
    several, or a key → name mapping (a None name: an unnamed key).

    Raises:
        ValueError: an empty key, or two keys with one name.
    """
    if keys is None:
        return {}
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, Mapping):
        keys = {k: None for k in keys}
    if any(not k for k in keys):
        raise ValueError("an API key must not be empty")
    named = len(keys) > 1 or any(n is not None for n in keys.values())
    out = {k: (n or key_user_name(k)) if named else None for k, n in keys.items()}
    names = [n for n in out.values() if n is not None]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"two API keys have the user name {dup!r}")
    return out


def find_key(keys: Mapping[str, Optional[str]], token: str) -> Optional[str]:
    """The configured key equal to ``token`` (compared in constant time each), else None."""
    found = None
    for k in keys:
        if hmac.compare_digest(token.encode(), k.encode()):
            found = k
    return found


def describe_user(user: Optional[str]) -> str:
    return f"user {user!r}" if user is not None else "anonymous requests (no 'user' field)"


@dataclasses.dataclass(eq=False)
class Charge:
    """What one request holds of its user's quotas (released once)."""

    user: Optional[str]
    tokens: int
    released: bool = False


class UserQuotas:
    """Per-user counts of requests and tokens in flight, checked against the limits (None: no
    limit). Used on the event loop only (no lock)."""

    def __init__(self, max_requests: Optional[int] = None, max_tokens: Optional[int] = None) -> None:
        for name, v in (("max_requests_per_user", max_requests), ("max_tokens_in_flight_per_user", max_tokens)):
            if v is not None and v < 1:
                raise ValueError(f"{name} must be ≥ 1, got {v}")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests: dict[Optional[str], int] = {}
        self.tokens: dict[Optional[str], int] = {}

    @property
    def enabled(self) -> bool:
        return self.max_requests is not None or self.max_tokens is not None

    def charge(self, user: Optional[str], tokens: int) -> Charge:
        """Count one request of ``user`` needing ``tokens`` in flight.

        Raises:
            APIError: 429 (``Retry-After``) over a quota; 400 when ``tokens`` alone is over
                the token quota.
        """
        who = describe_user(user)
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise APIError(400, f"this request needs {tokens} tokens in flight (prompt + max_tokens × n), more "
                                f"than the per-user limit of {self.max_tokens} (--max-tokens-in-flight-per-user); "
                                "lower max_tokens or n", param="max_tokens", code="user_token_limit")
        held = self.requests.get(user, 0)
        if self.max_requests is not None and held >= self.max_requests:
            raise APIError(429, f"{who} has {held} requests in flight, the limit "
                                f"(--max-requests-per-user) is {self.max_requests}; retry when one has finished",
                           type="rate_limit_error", code="user_request_limit",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        used = self.tokens.get(user, 0)
        if self.max_tokens is not None and used + tokens > self.max_tokens:
            raise APIError(429, f"{who} has {used} tokens in flight and this request needs {tokens} more, over the "
                                f"limit (--max-tokens-in-flight-per-user) of {self.max_tokens}; retry when one "
                                "has finished", type="rate_limit_error", code="user_token_limit",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.requests[user] = held + 1
        self.tokens[user] = used + tokens
        return Charge(user, tokens)

    def release(self, charge: Optional[Charge]) -> None:
        if charge is None or charge.released:
            return
        charge.released = True
        user = charge.user
        left = self.requests.get(user, 0) - 1
        if left > 0:
            self.requests[user] = left
            self.tokens[user] = self.tokens.get(user, 0) - charge.tokens
        else:
            self.requests.pop(user, None)
            self.tokens.pop(user, None)

    def in_flight(self, user: Optional[str]) -> tuple[int, int]:
        """(requests, tokens) of ``user`` in flight."""
        return self.requests.get(user, 0), self.tokens.get(user, 0)


def request_tokens(prompts: Iterable[Sequence[int]], params, max_model_len: int) -> int:
    """The tokens a request holds in flight: each prompt's plus its ``max_tokens`` (else what is
    left of ``max_model_len``) times the sequences it samples."""
    seqs = max(params.n, params.best_of or 0, (params.beam_width or 0) if params.use_beam_search else 0)
    total = 0
    for p in prompts:
        new = params.max_tokens if params.max_tokens is not None else max(0, max_model_len - len(p))
        total += len(p) + seqs * new
    return total
