"""Constrained decoding (SGLang's `regex`, `json_schema`, `ebnf`): grammars compiled by
xgrammar, one matcher per request (grammar.py), and the token masks they put on the target's
logits in plain decoding and at speculative verify (mask.py)."""
