"""Request ids as the user gave them."""

from __future__ import annotations

import re

# Upstream's input processor makes request ids unique by appending
# "-<8 hex chars>"; traces use the ids the user gave.
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
MAX_CACHED_IDS = 4096  # more than a batch holds: cleared at most once per ~4,000 new requests


class _UserIds(dict):
    """internal id -> user id, computed once per id (a C-level dict lookup on hits)."""

    def __missing__(self, internal_id: str) -> str:
        if len(self) >= MAX_CACHED_IDS:  # bounded: a long traced run sees many ids once each (~200 B each)
            self.clear()
        user = self[internal_id] = _SUFFIX.sub("", internal_id)
        return user


# user_req_id(internal_id) -> the id the user gave; hot paths map() it over a batch's ids.
user_req_id = _UserIds().__getitem__
