"""The hand-written cases of the scanner's differential tests (:mod:`support.scan_harness`):
fixture lines, adversarial lines, ragged streams, number texts, token ids, mutation seeds
and chunking text, with the tiny builders they are written with."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

import numpy as np

from support import FIXTURES
from support.scan_harness import ACCEPTED, Rejected, compact

FIXTURE_FILES = sorted(FIXTURES.glob("*.traces.jsonl"))


def nonblank_lines(path: Path) -> list[bytes]:
    """The lines of a file that are not blank (without their line breaks)."""
    return [line for line in path.read_bytes().splitlines() if line.strip()]


FIRST_LINES = [nonblank_lines(path)[0] for path in FIXTURE_FILES]
"""The first line of every fixture (``test_fixture_file`` ingests the whole files)."""
WHITESPACE_LINES = [b"", b"   ", b"\t", b"\r", b" \x0b ", b"\x0c", b" \t\r ", b"\x0b\x0c"]
"""Lines with no record on them (``bytes.strip()`` takes ``\\x0b`` and ``\\x0c`` for whitespace, JSON does not)."""


GOOD_EPISODE = compact(
    {
        "id": "ep-good",
        "group": {"id": "g"},
        "traces": [
            {
                "id": "tr-good",
                "nodes": [
                    {"message": {"role": "user", "content": "hi"}, "token_ids": [1, 2], "mask": [False, False]},
                    {
                        "parent": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "sampled": True,
                        "timestamp": 1.5,
                        "token_ids": [3, 4],
                        "mask": [True, True],
                        "logprobs": [-0.5, -0.25],
                    },
                ],
            }
        ],
    }
)
GOOD_BARE = compact({"id": "tr-bare", "nodes": [{"message": {"role": "system"}, "token_ids": [9], "mask": [False]}]})

USER = '{"message":{"role":"user","content":"q"},"token_ids":[1,2],"mask":[false,false]}'
"""Node 0 of the hand-written lines."""
REPLY = '{"parent":0,"message":{"role":"assistant","content":"a"},"sampled":true,"token_ids":[3],"mask":[true],"logprobs":[-0.5]}'  # noqa: E501
"""Node 1 of the hand-written lines."""


def episode(*nodes: str, episode_extra: str = "", trace_extra: str = "") -> bytes:
    """An episode line ``ep-x`` with one trace ``tr-x`` of the node texts given."""
    text = '{"id":"ep-x"' + episode_extra + ',"traces":[{"id":"tr-x"' + trace_extra + ',"nodes":[' + ",".join(nodes)
    return (text + "]}]}").encode()


def node(body: str) -> str:
    """A node with a plain message and ``body`` (more fields, comma-led when not empty)."""
    return '{"message":{"role":"user"}' + body + "}"


FULL = episode(USER, REPLY)


def user_in(template: str) -> str:
    """The template with :data:`USER` in place of ``<U>``."""
    return template.replace("<U>", USER)


def nest(depth: int, leaf: str = "0") -> str:
    """``leaf`` inside ``depth`` nested JSON arrays."""
    return "[" * depth + leaf + "]" * depth


def around(line: bytes) -> bytes:
    """The line as line 3 of a file: a good episode, a blank line before it, a good
    bare trace after it."""
    return b"\n".join([GOOD_EPISODE.encode(), b"", line, GOOD_BARE.encode()]) + b"\n"


CHUNK = "chunk"
"""``taken`` of a case whose bytes make the whole chunk fall back (text that is not UTF-8
in a column the block validates): no line of the file is taken."""


SURROGATE = "lone UTF-16 surrogate"
"""What the reason of a reject for a lone surrogate says."""
TOO_DEEP = "^nested too deeply"


def NON_FINITE(field: str, node: int | None = None, trace: str | None = "tr-x") -> Rejected:  # noqa: N802
    """The reject of a line whose ``field`` (the path down to the number) holds a NaN or
    an infinity (``1e400`` reads as one)."""
    return Rejected("^Input should be a finite number", field, node, trace)


"""How the reason of a reject for a value Python's ``json`` cannot read begins."""


class Case(NamedTuple):
    id: str
    line: bytes
    taken: bool | str
    alone: bool
    outcome: Rejected | str | None


def case(
    id: str,
    line: bytes | str,
    taken: bool | str = False,
    *,
    alone: bool = False,
    outcome: Rejected | str | None = None,
) -> Case:
    """A line, whether the scanner is meant to take it, whether it needs a file of its
    own, and (when the case says) how it is meant to end: :data:`ACCEPTED` or
    :class:`Rejected` (else only the same way on both paths)."""
    return Case(id, line.encode() if isinstance(line, str) else line, taken, alone or taken == CHUNK, outcome)


def bad(line: bytes, raw: bytes) -> bytes:
    """The line with its ``@@`` replaced by bytes that are not UTF-8."""
    return line.replace(b"@@", raw)


def _eat(line: bytes, at: bytes, keep: int) -> bytes:
    """The line cut ``keep`` bytes after the start of ``at`` (a truncated line)."""
    return line[: line.index(at) + keep]


IN_MESSAGE = Rejected(SURROGATE, "message", 0, "tr-x")
"""The reject of a line whose node 0 holds a lone surrogate in its message."""
TOO_DEEP_LINE = Rejected(TOO_DEEP, None, None, None)
"""The reject of a line too deep for Python's json (the line as a whole)."""
LOGPROBS_NULL = Rejected("", "logprobs", 0, "tr-x")
"""The reject of a line whose node 0 has ``"logprobs": null`` (pydantic words it)."""

ADVERSARIAL = [
    # text that is not one JSON object
    case("truncated-half", FULL[: len(FULL) // 2]),
    case("truncated-last-brace", FULL[:-1]),
    case("truncated-in-string", _eat(FULL, b'"q"', 2)),
    case("truncated-in-number", _eat(FULL, b"-0.5", 3)),
    case("truncated-after-key", _eat(FULL, b'"logprobs"', 11)),
    case("trailing-garbage", FULL + b"x"),
    case("trailing-second-record", FULL + b" {}"),
    case("trailing-comma", FULL + b","),
    case("trailing-nul", FULL + b"\x00"),
    case("trailing-whitespace", FULL + b" \t\r", True),
    case("leading-bom", b"\xef\xbb\xbf" + FULL),
    case("leading-form-feed", b"\x0c" + FULL),
    case("leading-vertical-tab", b"\x0b" + FULL),
    case("empty-object", "{}"),
    case("array", "[]"),
    case("array-of-episode", b"[" + FULL + b"]"),
    case("string", '"ep-x"'),
    case("number", "1"),
    case("null", "null"),
    case("true", "true"),
    # lines of whitespace only (bytes.strip() takes \x0b and \x0c for whitespace, JSON does not)
    case("spaces", "   "),
    case("tab", "\t"),
    case("carriage-return", "\r\r"),
    case("vertical-tab", "\x0b"),
    case("form-feed", "\x0c"),
    case("mixed-whitespace", " \x0b\t\x0c "),
    # record shapes
    case("episode-and-bare-trace", user_in('{"id":"ep-x","traces":[],"nodes":[<U>]}')),
    case("bare-trace-and-episode", user_in('{"id":"tr-x","nodes":[<U>],"traces":[]}')),
    case("episode-without-traces", '{"id":"ep-x"}', outcome=ACCEPTED),  # an episode with no traces
    case("nul-in-episode-key", episode(USER, episode_extra=',"x\\u0000":1')),
    case("nul-in-trace-key", episode(USER, trace_extra=',"x\\u0000":1')),
    case("nul-in-node-key", episode(node(',"x\\u0000":1'))),
    case("nul-in-message-key", episode('{"message":{"a\\u0000":1}}')),
    case("episode-traces-empty", '{"id":"ep-x","traces":[]}', True),
    case("episode-traces-null", '{"id":"ep-x","traces":null}'),
    case("episode-traces-object", '{"id":"ep-x","traces":{}}'),
    case("episode-id-number", '{"id":5,"traces":[]}'),
    case("episode-without-id", user_in('{"traces":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("episode-group-string", episode(USER, episode_extra=',"group":"g"')),
    case("episode-group-without-id", episode(USER, episode_extra=',"group":{}')),
    case("episode-ok-string", episode(USER, episode_extra=',"ok":"yes"')),
    case("episode-env", episode(USER, episode_extra=',"env":{"id":"e"},"group":{"id":"g","n":1}'), True),
    case("trace-version-string", episode(USER, trace_extra=',"version":"1"')),
    case("trace-rewards", episode(USER, trace_extra=',"rewards":{"a":{"score":0.5,"weight":2},"b":null}'), True),
    case("trace-rewards-score-string", episode(USER, trace_extra=',"rewards":{"a":{"score":"1"}}')),
    case("trace-flags", episode(USER, trace_extra=',"ok":true,"is_completed":true,"stop_condition":"done"'), True),
    case("second-trace-without-id", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]},{"nodes":[]}]}')),
    case("two-traces", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]},{"id":"tr-y"}]}'), True),
    case("two-traces-one-id", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]},{"id":"tr-x"}]}'), True),
    case("trace-not-object", '{"id":"ep-x","traces":[1]}'),
    case("trace-empty-object", '{"id":"ep-x","traces":[{}]}'),
    case("trace-without-id", user_in('{"id":"ep-x","traces":[{"nodes":[<U>]}]}')),
    case("trace-without-nodes", '{"id":"ep-x","traces":[{"id":"tr-x"}]}', True),
    case("trace-nodes-null", '{"id":"ep-x","traces":[{"id":"tr-x","nodes":null}]}'),
    case("bare-trace-nodes-empty", '{"id":"tr-x","nodes":[]}', True),
    case("bare-trace-nodes-null", '{"id":"tr-x","nodes":null}'),
    case("bare-trace-without-id", user_in('{"nodes":[<U>]}')),
    case("node-not-object", episode("1")),
    case("node-list", episode("[]")),
    case("node-empty-object", episode("{}")),
    case("node-without-message", episode('{"token_ids":[1],"mask":[true]}')),
    case("message-string", episode('{"message":"hi"}')),
    case("message-list", episode('{"message":[]}')),
    case("message-null", episode('{"message":null}')),
    case("message-number", episode('{"message":5}')),
    case("message-empty", episode('{"message":{}}'), True),
    case("role-number", episode('{"message":{"role":5}}'), True),
    case("role-null", episode('{"message":{"role":null}}'), True),
    case("role-non-ascii", episode('{"message":{"role":"usér"}}'), True),
    case("role-escaped", episode('{"message":{"role":"us\\u0065r"}}')),
    case("role-nested-only", episode('{"message":{"x":{"role":"user"}}}'), True),
    # duplicate keys
    case("duplicate-token_ids", episode(node(',"token_ids":[1],"mask":[true],"token_ids":[2]'))),
    case("duplicate-mask", episode(node(',"token_ids":[1],"mask":[true],"mask":[false]'))),
    case("duplicate-message", episode('{"message":{"role":"user"},"message":{"role":"tool"}}')),
    case("duplicate-parent", episode(USER, node(',"parent":0,"parent":0'))),
    case("duplicate-logprobs", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[1],"logprobs":[2]'))),
    case("duplicate-role", episode('{"message":{"role":"user","role":"assistant"}}')),
    case("duplicate-message-content", episode('{"message":{"role":"user","content":"a","content":"b"}}'), True),
    case("duplicate-traces", b'{"id":"ep-x","traces":[],"traces":[{"id":"tr-x","nodes":[]}]}'),
    case("duplicate-nodes", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[],"nodes":[<U>]}]}')),
    case("duplicate-bare-nodes", user_in('{"id":"tr-x","nodes":[],"nodes":[<U>]}')),
    case("duplicate-bare-trace-id", user_in('{"id":"tr-x","id":"tr-y","nodes":[<U>]}')),
    case("duplicate-episode-id", user_in('{"id":"ep-x","id":"ep-y","traces":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("duplicate-trace-id", user_in('{"id":"ep-x","traces":[{"id":"tr-x","id":"tr-y","nodes":[<U>]}]}')),
    case("duplicate-episode-field", episode(USER, episode_extra=',"ok":true,"ok":false')),
    case("duplicate-key-inside-episode-field", episode(USER, episode_extra=',"env":{"id":"a","id":"b"}')),
    case("duplicate-unknown-node-field", episode(node(',"x_note":1,"x_note":2'))),
    case("duplicate-trace-field", episode(USER, trace_extra=',"ok":true,"ok":false')),
    case("duplicate-key-inside-trace-field", episode(USER, trace_extra=',"rewards":{"a":{"score":1,"score":2}}')),
    case("duplicate-key-deep-in-episode-field", episode(USER, episode_extra=',"x":[1,[{"a":{"b":1,"b":1}}]]')),
    case("duplicate-bare-trace-field", user_in('{"id":"tr-x","x":1,"nodes":[<U>],"x":2}')),
    case("duplicate-key-inside-unknown-node-field", episode(node(',"x_meta":{"a":1,"b":{"c":1,"c":2}}'))),
    case("duplicate-key-deep-in-unknown-node-field", episode(node(',"x_meta":[[{"a":[{"d":null,"d":null}]}]]'))),
    case("duplicate-link-node", episode(USER, node(',"semantic_parents":[{"node":0,"node":0,"type":"x"}]'))),
    # a repeated key inside a message (other than "role") is not one the scanner looks
    # for: it keeps the text as written, which reads as the value the legacy path writes
    case("duplicate-key-inside-message", episode('{"message":{"role":"user","c":{"a":1,"a":2}}}'), True),
    # escaped keys
    case("escaped-token_ids-key", episode(node(',"\\u0074oken_ids":[1],"mask":[true]'))),
    case("escaped-nodes-key", user_in('{"id":"ep-x","traces":[{"id":"tr-x","\\u006eodes":[<U>]}]}')),
    case("escaped-traces-key", user_in('{"id":"ep-x","\\u0074races":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("escaped-bare-nodes-key", user_in('{"id":"tr-x","\\u006eodes":[<U>]}')),
    case("escaped-id-key", user_in('{"\\u0069d":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("escaped-role-key", episode('{"message":{"\\u0072ole":"user"}}')),
    case("escaped-link-key", episode(USER, node(',"semantic_parents":[{"\\u006eode":0,"type":"x"}]'))),
    case("escaped-unknown-node-key", episode(node(',"x\\u005fnote":1'))),
    case("escaped-key-inside-message", episode('{"message":{"role":"user","c":{"\\u0061":1}}}'), True),
    case("escaped-key-inside-unknown-field", episode(node(',"x_note":{"\\u0061":1}')), True),
    # nested lists where numbers or booleans belong
    case("nested-token_ids", episode(node(',"token_ids":[[1]],"mask":[true]'))),
    case("nested-token_ids-tail", episode(node(',"token_ids":[1,[2]],"mask":[true,true]'))),
    case("nested-logprobs", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[[-0.5]]'))),
    case("nested-advantages", episode(node(',"token_ids":[1,2],"mask":[true,true],"advantages":[0.5,[1]]'))),
    case("nested-mask", episode(node(',"token_ids":[1],"mask":[[true]]'))),
    case("nested-is_content", episode(node(',"token_ids":[1],"mask":[true],"is_content":[[true]]'))),
    # values of the wrong type
    case("token_ids-string-item", episode(node(',"token_ids":["1"],"mask":[true]'))),
    case("token_ids-null-item", episode(node(',"token_ids":[null],"mask":[true]'))),
    case("token_ids-bool-item", episode(node(',"token_ids":[true],"mask":[true]'))),
    case("token_ids-string", episode(node(',"token_ids":"12","mask":[true,true]'))),
    case("token_ids-null", episode(node(',"token_ids":null'))),
    case("logprobs-string-item", episode(node(',"token_ids":[1],"mask":[true],"logprobs":["0.5"]'))),
    case("logprobs-null-item", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[null]'))),
    case("logprobs-bool-item", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[true]'))),
    case("logprobs-string", episode(node(',"token_ids":[1],"mask":[true],"logprobs":"x"'))),
    case("advantages-null", episode(node(',"token_ids":[1],"mask":[true],"advantages":null')), True),
    case("reference_logprobs-null", episode(node(',"token_ids":[1],"mask":[true],"reference_logprobs":null')), True),
    case("trainer_logprobs-null", episode(node(',"token_ids":[1],"mask":[true],"trainer_logprobs":null')), True),
    case("entropies-null", episode(node(',"token_ids":[1],"mask":[true],"entropies":null')), True),
    case(
        "optional-streams-null",
        episode(
            node(',"token_ids":[],"mask":[],"advantages":null,"reference_logprobs":null,"trainer_logprobs":null'),
            node(',"entropies":null,"logprobs":[]'),
        ),
        True,
        outcome=ACCEPTED,
    ),
    # logprobs is a list, empty when unknown: null is rejected (the scanner leaves the wording to the legacy path)
    case("logprobs-null", episode(node(',"token_ids":[1],"mask":[true],"logprobs":null')), outcome=LOGPROBS_NULL),
    case(
        "logprobs-null-second-node-of-bare-trace",
        user_in('{"id":"tr-x","nodes":[<U>,{"parent":0,"message":{"role":"a"},"logprobs":null}]}'),
        outcome=Rejected("", "logprobs", 1, "tr-x"),
    ),
    case("logprobs-null-no-tokens", episode(node(',"logprobs":null')), outcome=LOGPROBS_NULL),
    case("timestamp-string", episode(node(',"timestamp":"5"'))),
    case("timestamp-bool", episode(node(',"timestamp":true'))),
    case("timestamp-null", episode(node(',"timestamp":null'))),
    case("timestamp-object", episode(node(',"timestamp":{}'))),
    case("parent-string", episode(USER, node(',"parent":"0"'))),
    case("parent-bool", episode(USER, node(',"parent":true'))),
    case("parent-fraction", episode(USER, node(',"parent":0.5'))),
    case("parent-float-integral", episode(USER, node(',"parent":0.0'))),
    case("parent-exponent", episode(USER, USER, node(',"parent":1e0'))),
    case("parent-null", episode(node(',"parent":null')), True),
    case("parent-negative-zero", episode(USER, node(',"parent":-0')), True),
    case("sampled-string", episode(node(',"sampled":"true"'))),
    case("sampled-number", episode(node(',"sampled":1'))),
    case("sampled-null", episode(node(',"sampled":null'))),
    case("mask-number-item", episode(node(',"token_ids":[1],"mask":[1]'))),
    case("mask-null-item", episode(node(',"token_ids":[1],"mask":[null]'))),
    case("mask-null", episode(node(',"token_ids":[1],"mask":null'))),
    case("mask-string-item", episode(node(',"token_ids":[1],"mask":["true"]'))),
    case("mask-truncated-literal", episode(node(',"token_ids":[1],"mask":[fals]'))),
    case("is_content-null", episode(node(',"token_ids":[1],"mask":[true],"is_content":null'))),
    case("semantic_parents-null", episode(USER, node(',"semantic_parents":null'))),
    case("semantic_parents-object", episode(USER, node(',"semantic_parents":{}'))),
    case("semantic_parents-string", episode(USER, node(',"semantic_parents":"x"'))),
    # layout and graph rules
    case("mask-shorter-than-tokens", episode(node(',"token_ids":[1,2],"mask":[true]'))),
    case("mask-without-tokens", episode(node(',"mask":[true]'))),
    case("is_content-length", episode(node(',"token_ids":[1,2],"mask":[true,true],"is_content":[true]'))),
    case("is_content-empty", episode(node(',"token_ids":[1,2],"mask":[true,true],"is_content":[]')), True),
    case("logprobs-longer-than-sampled", episode(node(',"token_ids":[1,2],"mask":[false,true],"logprobs":[1,2]'))),
    case("entropies-shorter-than-sampled", episode(node(',"token_ids":[1,2],"mask":[true,true],"entropies":[1]'))),
    case("noncanonical-mask", episode(node(',"token_ids":[1,2,3],"mask":[true,false,true],"logprobs":[1,2]')), True),
    case("parent-own-index", episode(node(',"parent":0'))),
    case("parent-later-node", episode(USER, node(',"parent":5'))),
    case("parent-minus-one", episode(USER, node(',"parent":-1'))),
    case("parent-huge", episode(USER, node(',"parent":99999999999'))),
    case("link-forward", episode(node(',"semantic_parents":[{"node":1,"type":"x"}]'), USER)),
    case("link-to-itself", episode(USER, node(',"semantic_parents":[{"node":1,"type":"x"}]'))),
    case("link-negative", episode(USER, node(',"semantic_parents":[{"node":-1,"type":"x"}]'))),
    case("link-extra-key", episode(USER, node(',"semantic_parents":[{"node":0,"type":"x","w":1}]'))),
    case("link-without-node", episode(USER, node(',"semantic_parents":[{"type":"x"}]'))),
    case("link-without-type", episode(USER, node(',"semantic_parents":[{"node":0}]'))),
    case("link-empty-object", episode(USER, node(',"semantic_parents":[{}]'))),
    case("link-node-string", episode(USER, node(',"semantic_parents":[{"node":"0","type":"x"}]'))),
    case("link-node-fraction", episode(USER, node(',"semantic_parents":[{"node":0.0,"type":"x"}]'))),
    case("link-type-number", episode(USER, node(',"semantic_parents":[{"node":0,"type":1}]'))),
    case("link-type-non-ascii", episode(USER, node(',"semantic_parents":[{"type":"sü","node":0}]')), True),
    case("link-type-escaped", episode(USER, node(',"semantic_parents":[{"node":0,"type":"\\u0078"}]'))),
    case("link-not-object", episode(USER, node(',"semantic_parents":[0]'))),
    # loss_weights
    case("loss_weights-object", episode(node(',"token_ids":[1,2],"mask":[false,true],"loss_weights":{"rl":[1,0.5]}'))),
    case("loss_weights-empty-object", episode(node(',"loss_weights":{}'))),
    case("loss_weights-length", episode(node(',"token_ids":[1,2],"mask":[false,true],"loss_weights":{"rl":[1]}'))),
    case("loss_weights-null", episode(node(',"loss_weights":null')), True),
    case("loss_weights-list", episode(node(',"loss_weights":[]'))),
    case("loss_weights-null-stream", episode(node(',"loss_weights":{"rl":null}'))),
    # unknown fields
    case("unknown-nested", episode(node(',"x_meta":{"a":[1,{"b":null}],"c":"d","e":[true,false,[]]}')), True),
    case("unknown-nested-non-ascii", episode(node(',"x_meta":{"c":"dé","ü":[1]}')), True),
    case("unknown-number-forms", episode(node(',"x_meta":[1.50,1E3,-0,1e-7]')), True),
    case("unknown-escapes", episode(node(',"x_meta":"a\\/b\\u00e9"')), True),
    case(
        "unknown-trace-and-episode-fields",
        episode(USER, episode_extra=',"x":{"é":[1.50]}', trace_extra=',"y":-0'),
        True,
    ),  # noqa: E501
    # message text, kept as written by the scanner (compared by value)
    case("message-escapes", episode('{"message":{"role":"user","content":"a\\n\\t\\"\\\\b\\u0000"}}'), True),
    case("message-short-escapes", episode('{"message":{"role":"user","content":"\\b\\f\\r\\u0001\\u001f"}}'), True),
    case("message-unicode-escape", episode('{"message":{"role":"user","content":"\\u00e9"}}'), True),
    case("message-escaped-slash", episode('{"message":{"role":"user","content":"a\\/b"}}'), True),
    case("message-uppercase-escape", episode('{"message":{"role":"user","content":"\\u001F"}}'), True),
    case("message-non-ascii", episode('{"message":{"role":"user","content":"é😀"}}'), True),
    case("message-number-forms", episode('{"message":{"role":"user","n":[1.50,1E3,-0,1e-7]}}'), True),
    case("message-whitespace", episode('{"message": { "role" : "user" , "content" : [ 1 , { } ] } }'), True),
    # text that is not UTF-8 (the whole chunk falls back: alone), control characters, lone surrogates
    case("role-invalid-utf8", bad(episode(node("")).replace(b'"user"', b'"us@@er"'), b"\xff"), CHUNK),
    case("message-truncated-utf8", bad(episode('{"message":{"role":"user","content":"@@"}}'), b"\xc3"), CHUNK),
    case("message-overlong-utf8", bad(episode(USER).replace(b'"q"', b'"@@"'), b"\xc0\xaf"), CHUNK),
    case("unknown-key-invalid-utf8", bad(episode(node(',"x@@":1')), b"\xff"), CHUNK),
    case("unknown-value-invalid-utf8", bad(episode(node(',"x":["@@"]')), b"\xfe"), CHUNK),
    case(
        "link-type-invalid-utf8",
        bad(episode(USER, node(',"semantic_parents":[{"node":0,"type":"@@"}]')), b"\xff"),
        CHUNK,
    ),  # noqa: E501
    case("episode-field-invalid-utf8", bad(episode(USER, episode_extra=',"x":"@@"'), b"\xff")),
    case("trace-field-invalid-utf8", bad(episode(USER, trace_extra=',"x":"@@"'), b"\x80")),
    case("message-control-character", episode('{"message":{"role":"user","content":"a\x01b"}}')),
    case("message-raw-tab", episode('{"message":{"role":"user","content":"a\tb"}}')),
    case("episode-control-character", episode(USER, episode_extra=',"x":"\x1f"')),
    case("key-control-character", episode(node(',"x\x1f":1'))),
    # lone UTF-16 surrogates, escaped or encoded as UTF-8 (ED A0..BF ..): not Unicode text, so
    # the line is rejected both ways, naming the top-level key of the episode, trace or node
    # that holds one (a path that misses one fails when DuckDB stores the text: a trace id,
    # written into the reject too, and bytes the scanner copies alone)
    case("message-lone-surrogate", episode('{"message":{"role":"user","content":"\\ud800"}}'), outcome=IN_MESSAGE),
    case("message-high-surrogate-then-letter", episode('{"message":{"content":"\\ud800\\u0041"}}'), outcome=IN_MESSAGE),
    case("message-low-then-high-surrogate", episode('{"message":{"content":"\\udc00\\ud800"}}'), outcome=IN_MESSAGE),
    case(
        "message-high-surrogate-at-end", episode('{"message":{"role":"user","content":"a\\udbff"}}'), outcome=IN_MESSAGE
    ),
    case("message-key-lone-surrogate", episode('{"message":{"role":"user","c\\udc00":1}}'), outcome=IN_MESSAGE),
    case("role-lone-surrogate", episode('{"message":{"role":"\\uDBFF"}}'), outcome=IN_MESSAGE),
    case(
        "unknown-lone-surrogate", episode(node(',"x_note":"\\udc00"')), outcome=Rejected(SURROGATE, "x_note", 0, "tr-x")
    ),
    case(
        "unknown-nested-lone-surrogate",
        episode(node(',"x_n":{"a":[1,{"b":"\\ud800"}]}')),
        outcome=Rejected(SURROGATE, "x_n", 0, "tr-x"),
    ),
    case(
        "link-type-lone-surrogate",
        episode(USER, node(',"semantic_parents":[{"node":0,"type":"\\ud800"}]')),
        outcome=Rejected(SURROGATE, "semantic_parents", 1, "tr-x"),
    ),
    case(
        "episode-field-lone-surrogate",
        episode(USER, episode_extra=',"x":"\\ud800"'),
        outcome=Rejected(SURROGATE, "x", None, None),
    ),
    case(
        "episode-id-lone-surrogate",
        user_in('{"id":"ep-\\ud800","traces":[{"id":"tr-x","nodes":[<U>]}]}'),
        outcome=Rejected(SURROGATE, "id", None, None),
    ),
    case(
        "trace-field-lone-surrogate",
        episode(USER, trace_extra=',"y":["\\udfff"]'),
        outcome=Rejected(SURROGATE, "y", None),
    ),
    case(
        "bare-trace-field-lone-surrogate",
        user_in('{"id":"tr-x","y":"\\ud800","nodes":[<U>]}'),
        outcome=Rejected(SURROGATE, "y", None),
    ),
    case(
        "trace-id-lone-surrogate",
        episode(USER).replace(b'"tr-x"', b'"tr-\\udfff"'),
        alone=True,
        outcome=Rejected(SURROGATE, "id", None),
    ),
    case(
        "bare-trace-id-lone-surrogate",
        user_in('{"id":"tr-\\ud800","nodes":[<U>]}'),
        alone=True,
        outcome=Rejected(SURROGATE, "id", None),
    ),
    # a key of its own that holds one: rejected both ways (pydantic words it: such a key
    # is no field name to report)
    case(
        "episode-key-lone-surrogate",
        episode(USER, episode_extra=',"x\\udc00":1'),
        outcome=Rejected("", node=None, trace=None),
    ),
    case("trace-key-lone-surrogate", episode(USER, trace_extra=',"x\\udc00":1'), outcome=Rejected("", node=None)),
    case("node-key-lone-surrogate", episode(node(',"x\\ud800":1')), outcome=Rejected("", node=0, trace="tr-x")),
    # encoded as UTF-8 (the whole chunk falls back when the bytes are in a node)
    case(
        "message-utf8-surrogate",
        bad(episode(USER).replace(b'"q"', b'"@@"'), b"\xed\xa0\x80"),
        CHUNK,
        outcome=IN_MESSAGE,
    ),
    case("role-utf8-surrogate", bad(episode('{"message":{"role":"@@"}}'), b"\xed\xbf\xbf"), CHUNK, outcome=IN_MESSAGE),
    case(
        "message-key-utf8-surrogate", bad(episode('{"message":{"c@@":1}}'), b"\xed\xa0\x80"), CHUNK, outcome=IN_MESSAGE
    ),
    case(
        "unknown-utf8-surrogate",
        bad(episode(node(',"x_note":["@@"]')), b"\xed\xb0\x80"),
        CHUNK,
        outcome=Rejected(SURROGATE, "x_note", 0, "tr-x"),
    ),
    case(
        "node-key-utf8-surrogate", bad(episode(node(',"x@@":1')), b"\xed\xa0\x80"), CHUNK, outcome=Rejected("", node=0)
    ),
    case(
        "episode-field-utf8-surrogate",
        bad(episode(USER, episode_extra=',"x":"@@"'), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected(SURROGATE, "x", None, None),
    ),
    case(
        "episode-key-utf8-surrogate",
        bad(episode(USER, episode_extra=',"x@@":1'), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected("", node=None, trace=None),
    ),
    case(
        "trace-field-utf8-surrogate",
        bad(episode(USER, trace_extra=',"x":"@@"'), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected(SURROGATE, "x", None),
    ),
    case(
        "bare-trace-field-utf8-surrogate",
        bad(user_in('{"id":"tr-x","x":"@@","nodes":[<U>]}').encode(), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected(SURROGATE, "x", None),
    ),
    case(
        "trace-id-utf8-surrogate",
        episode(USER).replace(b'"tr-x"', b'"tr-\xed\xa0\x80"'),
        alone=True,
        outcome=Rejected(SURROGATE, "id", None),
    ),
    # a high and a low surrogate escaped as a pair are one code point: fine
    case("message-surrogate-pair", episode('{"message":{"role":"user","content":"\\ud83d\\ude00"}}'), True),
    case(
        "message-surrogate-pair-uppercase", episode('{"message":{"content":"\\uD83D\\uDE00"}}'), True, outcome=ACCEPTED
    ),
    case("unknown-surrogate-pair", episode(node(',"x_note":["\\udbff\\udfff"]')), True, outcome=ACCEPTED),
    case("unknown-key-surrogate-pair", episode(node(',"x\\ud83d\\ude00":1')), outcome=ACCEPTED),  # an escaped key
    # NaN and infinities
    case("logprobs-nan", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[NaN]'))),
    case("logprobs-infinity", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[Infinity]'))),
    case("logprobs-minus-infinity", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[-Infinity]'))),
    case("timestamp-nan", episode(node(',"timestamp":NaN'))),
    # ... nor anywhere in free-form JSON: rejected naming the path down to the number
    case("episode-field-nan", episode(USER, episode_extra=',"x":NaN'), outcome=NON_FINITE("x", None, None)),
    case(
        "message-infinity",
        episode('{"message":{"role":"user","n":Infinity}}'),
        outcome=NON_FINITE("message.n", 0),
    ),
    case("unknown-nan", episode(node(',"x_note":NaN')), outcome=NON_FINITE("x_note", 0)),
    case("metrics-nan", episode(USER, trace_extra=',"metrics":{"turns":NaN}'), outcome=NON_FINITE("metrics.turns")),
    case(
        "info-nested-minus-infinity",
        episode(USER, trace_extra=',"info":{"a":[1,{"b":-Infinity}]}'),
        outcome=NON_FINITE("info.a.1.b"),
    ),
    case(
        "metrics-1e400",
        episode(USER, trace_extra=',"metrics":{"turns":5,"big":1e400}'),
        alone=True,
        outcome=NON_FINITE("metrics.big"),
    ),
    case(
        "timing-minus-1e400",
        episode(USER, trace_extra=',"timing":{"agent":{"end":-1.5e400}}'),
        alone=True,
        outcome=NON_FINITE("timing.agent.end"),
    ),
    case(
        "message-1e400",
        episode('{"message":{"role":"user","x":[0.5,1E+400]}}'),
        alone=True,
        outcome=NON_FINITE("message.x.1", 0),
    ),
    case(
        "message-long-fraction-beyond-double",
        episode('{"message":{"role":"user","x":' + "9" * 320 + ".5}}"),
        alone=True,
        outcome=NON_FINITE("message.x", 0),
    ),
    case(
        "unknown-0.1e310",
        episode(node(',"x_note":{"v":0.1e310}')),
        alone=True,
        outcome=NON_FINITE("x_note.v", 0),
    ),
    # finite however they are written: kept (the largest doubles go through the parser)
    case("message-1.7e308", episode('{"message":{"role":"user","x":1.7e308}}'), alone=True, outcome=ACCEPTED),
    case("message-tiny", episode('{"message":{"role":"user","x":1e-400}}'), True, outcome=ACCEPTED),
    case("message-1e307", episode('{"message":{"role":"user","x":1e307}}'), True, outcome=ACCEPTED),
    case(
        "message-400-digit-integer",
        episode('{"message":{"role":"user","x":' + "9" * 400 + "}}"),
        True,
        outcome=ACCEPTED,
    ),
    # deep nesting: the scanner takes values up to 512 levels deep (a message's value
    # counts its own level) and leaves deeper ones to the legacy path, which reads what
    # Python's json reads (about 900 levels, depending on the stack) and rejects the rest
    case("unknown-field-512-deep", episode(node(',"x_deep":' + nest(512))), True, outcome=ACCEPTED),
    case("unknown-field-513-deep", episode(node(',"x_deep":' + nest(513))), outcome=ACCEPTED),
    case("message-512-deep", episode('{"message":{"role":"user","c":' + nest(511) + "}}"), True, outcome=ACCEPTED),
    case("message-513-deep", episode('{"message":{"role":"user","c":' + nest(512) + "}}"), outcome=ACCEPTED),
    case("episode-field-512-deep", episode(USER, episode_extra=',"x":' + nest(512)), True, outcome=ACCEPTED),
    case("episode-field-513-deep", episode(USER, episode_extra=',"x":' + nest(513)), outcome=ACCEPTED),
    case("unknown-field-600-deep", episode(node(',"x_deep":' + nest(600))), outcome=ACCEPTED),
    case(
        "unknown-field-600-deep-objects",
        episode(node(',"x_deep":' + '{"a":' * 600 + "0" + "}" * 600)),
        outcome=ACCEPTED,
    ),
    case("message-600-deep", episode('{"message":{"role":"user","c":' + nest(600) + "}}"), outcome=ACCEPTED),
    case("episode-field-600-deep", episode(USER, episode_extra=',"x":' + nest(600)), outcome=ACCEPTED),
    case("trace-field-600-deep", episode(USER, trace_extra=',"x":' + nest(600)), outcome=ACCEPTED),
    case("bare-trace-field-600-deep", user_in('{"id":"tr-x","x":' + nest(600) + ',"nodes":[<U>]}'), outcome=ACCEPTED),
    case("unknown-field-800-deep", episode(node(',"x_deep":' + nest(800)))),  # accepted or not: the stack decides
    case("unknown-field-1020-deep", episode(node(',"x_deep":' + nest(1020))), outcome=TOO_DEEP_LINE),
    case("message-1020-deep", episode('{"message":{"role":"user","c":' + nest(1020) + "}}"), outcome=TOO_DEEP_LINE),
    case("unknown-field-2000-deep", episode(node(',"x_deep":' + nest(2000))), outcome=TOO_DEEP_LINE),
    case("message-2000-deep", episode('{"message":{"role":"user","c":' + nest(2000) + "}}"), outcome=TOO_DEEP_LINE),
    case("episode-field-2000-deep", episode(USER, episode_extra=',"x":' + nest(2000)), outcome=TOO_DEEP_LINE),
    # lines the legacy path parses with json + pydantic (simdjson fails on a number beyond
    # 64 bits, or the "[" count of the line disagrees with its arrays because of an escaped
    # "[") while the scanner takes them
    case("bigint-in-episode", episode(USER, REPLY, episode_extra=',"big":18446744073709551616'), True),
    case("escaped-bracket-in-message", episode('{"message":{"role":"user","content":"\\u005b"}}', REPLY), True),
    # ... and with "logprobs": null too, rejected both ways
    case(
        "logprobs-null-bigint-in-episode",
        episode(node(',"token_ids":[1],"mask":[true],"logprobs":null'), episode_extra=',"big":18446744073709551616'),
        outcome=LOGPROBS_NULL,
    ),
    case(
        "logprobs-null-escaped-bracket",
        episode('{"message":{"role":"user","content":"\\u005b"},"token_ids":[1],"mask":[true],"logprobs":null}'),
        outcome=LOGPROBS_NULL,
    ),
    case("negative-zero-logprob", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[-0]')), True),
    case("negative-zero-timestamp", episode(node(',"timestamp":-0')), True),
]
"""Lines by hand, each a :func:`case`: malformed text, record shapes, repeated and escaped keys,
values of the wrong type, layout and graph rules, text that is not UTF-8, lone surrogates,
NaN, deep nesting, and lines the legacy path reads with ``json`` while the scanner takes them."""


RAGGED = [
    case("ragged-longer", episode(node(',"token_ids":[1,2],"mask":[false,true],"logprobs":[1,2,3]')), True),
    case("ragged-shorter", episode(node(',"token_ids":[1,2],"mask":[true,true],"advantages":[1]')), True),
    case("ragged-no-sampled", episode(node(',"token_ids":[1],"mask":[false],"entropies":[0.5]')), True),
    case(
        "ragged-null-and-ragged",
        episode(node(',"token_ids":[1],"mask":[true],"advantages":null,"entropies":[1,2]')),
        True,
    ),
    case("ragged-mask-length", episode(node(',"token_ids":[1,2],"mask":[true],"logprobs":[1]'))),
    case("ragged-parent-forward", episode(USER, node(',"parent":3,"logprobs":[1,2]'))),
    case("ragged-loss_weights-length", episode(node(',"token_ids":[1],"mask":[true],"loss_weights":{"rl":[]}'))),
    case("ragged-nested-logprobs", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[[1],2]'))),
    case("ragged-is_content-length", episode(node(',"token_ids":[1],"mask":[true],"is_content":[true,true]'))),
]
"""Lines whose compact streams disagree with their sampled tokens (taken with ``allow_ragged``),
and lines breaking rules ``allow_ragged`` does not lift."""


def _f32_text(value: float) -> str:
    """The 17 significant digits repr of a float32 value, as a double."""
    return repr(float(np.float32(value)))


def _halfway(value: float, places: str = "f") -> list[str]:
    """Decimal texts at, just above and just below the point halfway between the float32
    ``value`` and its upper neighbour (exact decimals: float32 and double values are
    dyadic), and that point rounded to 17 significant digits."""
    a = np.float32(value)
    with np.errstate(over="ignore"):
        b = np.nextafter(a, np.float32(np.inf))
    upper = Decimal(float(b)) if np.isfinite(b) else Decimal(2) ** 128  # above the largest float32
    mid = (Decimal(float(a)) + upper) / 2
    tiny = Decimal(1).scaleb(mid.adjusted() - 30)
    return [format(mid, places), format(mid + tiny, places), format(mid - tiny, places), f"{float(mid):.17g}"]


NUMBER_TEXTS = [
    # integers
    "0",
    "1",
    "-1",
    "42",
    "123456789",
    "9007199254740993",
    # negative zero: the integer -0 is 0 (+0.0), the others are floats (-0.0)
    "-0",
    "-0.0",
    "-0e0",
    "-0E+2",
    "-0.0E-5",
    "-0.000",
    # 17 significant digits of float32 values
    *(_f32_text(v) for v in (0.1, -2.3456789, 1e-30, 3.4028235e38, 1.4e-45, 16777217.0, -7.0e-39)),
    # exponents
    "1e-5",
    "1E+3",
    "2.5e-3",
    "-4.5E-07",
    "1e22",
    "1e23",
    "123456e-28",
    "5e-324",
    "2.4703282292062328e-324",
    "1e308",
    "1.7976931348623157e308",
    "1e39",
    "-1e-400",
    "1e-99999999999",
    # more than 19 digits
    "12345678901234567890123",
    "-98765432109876543210.5",
    "0.12345678901234567890123",
    "1.00000000000000000000001",
    "0." + "0" * 399 + "1",
    # leading zeros in the fraction
    "0.000000000000000000001234",
    "-0.0000001",
    "0.0000000000000000000000000000000001",
    # halfway between float32 neighbours
    *_halfway(1.0),
    *_halfway(0.1),
    *_halfway(-3.0e38, "e"),
    *_halfway(1.0e-40, "e"),
    *_halfway(float(np.finfo(np.float32).max), "e"),
]
BEYOND_DOUBLE = ["1e400", "-1e400", "1" + "0" * 400]
"""Numbers beyond the double range: the whole chunk falls back (so, files of their own)."""


TOKEN_TEXTS = [
    ("2147483647", True),
    ("-2147483648", True),
    ("0", True),
    ("-0", True),
    (" 5 ", True),
    ("2147483648", False),
    ("-2147483649", False),
    ("99999999999999999999", False),
    ("1.0", False),
    ("1e2", False),
    ("1E2", False),
    ("01", False),
    ("-01", False),
    ("00", False),
    ("+1", False),
    ("-", False),
    ("true", False),
    ("null", False),
    ('"1"', False),
]
"""(the text of a token id as written, whether the scanner takes the line)."""


MUTATION_SEEDS = [
    FULL,
    GOOD_EPISODE.encode(),
    GOOD_BARE.encode(),
    episode(
        USER,
        node(
            ',"semantic_parents":[{"node":0,"type":"compaction"}],"timestamp":12.5,"token_ids":[5,6,7],'
            '"mask":[false,true,true],"logprobs":[-0.1,-0.25],"advantages":[1,0],"is_content":[true,true,false],'
            '"x_n":{"a":[1,"b"]}'
        ),
        trace_extra=',"rewards":{"r":{"score":1}},"ok":true',
    ),
    b'{"id":"tr-b","x":{"y":[1,2]},"nodes":[{"message":{"role":"tool","content":[{"type":"text","text":"hi"}]},'
    b'"parent":null,"sampled":false,"token_ids":[1],"mask":[false],"is_content":[],"logprobs":[],"advantages":null,'
    b'"semantic_parents":[],"loss_weights":null}]}',
    episode(
        '{"message":{"role":"usér","content":"a\\u00e9\\n\\ud83d\\ude00","n":[1.50,-0,1E3]}}',
        node(',"parent":0,"x_m":{"é":[-0.0,2e-3,"\\/"]},"token_ids":[1],"mask":[true],"logprobs":[-0]'),
        episode_extra=',"x":{"ü":[1.5e1]}',
    ),
]
"""Lines to mutate, one with text the scanner keeps as written and the legacy path writes
otherwise (non-ASCII, escapes, exponents, -0)."""
MUTATION_TEXT = [
    *(bytes([c]) for c in b'01-.eE+"\\[]{},: \t'),
    b"null",
    b"true",
    b"false",
    b"9" * 25,
    b"1e400",
    b"\\u0000",
    b"\xff",
    b'"x":1,',
    b'"id":"z",',
    b'"parent":0,',
    b'"nodes":[],',
    b'"traces":[],',
    b'"role":"x",',
    b'"message":{},',
    b'"mask":[true],',
    b'"token_ids":[1],',
    b'"logprobs":null,',
]


SMALL_TEXT = b"\n".join(
    [
        GOOD_EPISODE.encode(),
        b"",
        b"  \t",
        GOOD_BARE.encode() + b"\r",
        b"\x0b",
        b"{}",
        b"\r\r",
        FULL,
        b"x" * 150,
        b"",
    ]
)
"""Lines of every kind for the chunk tests: records, blank, whitespace only, CR-ended, malformed, long."""
