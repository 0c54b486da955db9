"""Error codes that cross a process boundary: the engines answer with them, the router acts on
them. One definition here (torch-free), so the two sides cannot drift."""

from __future__ import annotations

__all__ = ["INVALID_GRAMMAR", "KV_TRANSFER_FAILED"]

KV_TRANSFER_FAILED = "kv_transfer_failed"
"""What an error about a failed KV load starts with, and its OpenAI error code (HTTP 503): the
prompt's KV never arrived, so a router may retry the request elsewhere (decode-only)."""

INVALID_GRAMMAR = "invalid_grammar"
"""What an error about a structured-output constraint that does not compile starts with, and
its OpenAI error code (HTTP 400): the request's schema, regex or grammar is at fault."""
