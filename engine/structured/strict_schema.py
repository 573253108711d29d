"""Rewrites that let llguidance enforce what its lenient mode would only relax (before
engine/structured/relaxed_schema.py).

Each rewrite gives a schema whose valid values are the original's or fewer (never more), so what it enforces
needs no check afterwards:
- `if`/`then`/`else` whose `if` is a discriminator (a boolean; `properties` with `const` / `enum` values, nested
  such objects or `true`; `required`; their anyOf / allOf) become anyOf[allOf[if, then], allOf[not-if, else]],
  not-if written out (a property absent: `properties: {k: false}`; a value outside a finite set of strings: a
  regex of every other string); several on one property's value become one anyOf of its values (a switch: the
  values' count, not 2**conditionals). A conditional out of that fragment stays for lenient mode.
- `oneOf` becomes anyOf where its branches exclude each other (types, constants, a required property's
  constants) or each can carry the others' negations (`oneOf: [{required: [a]}, {required: [b]}]`).
- `dependentRequired`, `dependentSchemas` and `dependencies` become anyOf[the key absent, the key and its needs].
- an `integer` with an open side gets the bound of I-JSON's safe range (+-(2**53 - 1), RFC 7493): a number
  past it loses digits in most JSON parsers (JavaScript's, and any float), and a random model under no bound
  writes digits until max_tokens.
- a `properties` entry of a branch (allOf / anyOf / oneOf member, if / then / else / not) that restates the
  node's own (the same schema, or a $ref to it) or says nothing goes, where that branch closes no keys: the node
  already holds it (llguidance intersects the two, over its size limit where the schema has conditionals of its
  own: Dependabot's `schedule`; negate() cannot write a $ref's negation: its `directory` / `directories` oneOf).
- `uniqueItems` over a small enum (or const) of items becomes the enum of the arrays it allows, each set of values
  once, in the enum's order.
- `unevaluatedProperties` becomes `additionalProperties` where the evaluated keys are known without the value
  (engine/structured/unevaluated.py; first, before the rewrites below move keywords into branches).
- `date-time`, `date` and `time` get the pattern of what the output check's format checker (jsonschema with
  rfc3339-validator) accepts: llguidance's own regexes let through a 60th second, year 0 and 29 February of any
  year. `json-pointer` and `relative-json-pointer` (unknown to llguidance, which would relax them) become the
  pattern of RFC 6901's grammar.

No torch, no llguidance.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from typing import Any

from engine.structured.one_of import all_disjoint, branch_facts, narrow
from engine.structured.unevaluated import rewrite_unevaluated

MAX_CONDITIONALS = 8  # if/then/else rewritten two ways per object: each doubles what llguidance intersects there
SAFE_INTEGER = 2**53 - 1
MAX_CASES = 64  # values of one switch (conditionals on one property's value)
MAX_ONE_OF = 8  # oneOf branches rewritten with the others' negations (n - 1 each)
MAX_UNIQUE = 8  # enum values whose unique arrays are listed (2**8 arrays at most)
_ARRAY_OTHER = frozenset({"prefixItems", "additionalItems", "contains", "unevaluatedItems"})
_ANNOTATIONS = frozenset({"title", "description", "markdownDescription", "$comment", "examples", "default"})
_OTHER_TYPES = ["object", "array"]
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)"
)
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_POINTER = "(?:/(?:[^~/]|~[01])*)*"  # RFC 6901: "/"-led tokens, "~" only as ~0 or ~1
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[tT]{_TIME}$",
    "json-pointer": f"^{_POINTER}$",
    # draft 2019-09's form (a count of levels up, then "#" or a pointer); 2020-12's index shift (+n/-n) is left out
    "relative-json-pointer": f"^(?:0|[1-9][0-9]*)(?:#|{_POINTER})$",
}
NEW_FORMATS = frozenset({"json-pointer", "relative-json-pointer"})  # llguidance knows none: the pattern replaces it


def rewrite(schema: dict[str, Any], *, conditionals: bool = True) -> dict[str, Any]:
    """The schema with the rewrites above applied (a copy), or the schema itself when none applies.
    conditionals=False: all but the if/then/else ones (whose anyOf can multiply past llguidance's limits).
    A keyword some $ref points through (`#/.../oneOf/1`) is not rewritten: the pointer would lose its target."""
    work = copy.deepcopy(schema)
    nodes = _nodes(work)
    pointed: set[str] = set()
    for n in nodes:
        pointed |= _keywords_in(n["$ref"]) if isinstance(n.get("$ref"), str) else frozenset()
    steps: list[Callable[[dict[str, Any]], bool]] = []
    steps += [] if pointed & _BRANCH_KEYS else [functools.partial(_restated, root=work)]
    steps += [_format, _safe_integer]
    steps += [] if "enum" in pointed else [_unique_enum]
    steps += [] if pointed & {"dependencies", "dependentRequired", "dependentSchemas"} else [_dependencies]
    steps += [] if "oneOf" in pointed else [functools.partial(_one_of, root=work)]
    steps += [] if "not" in pointed else [_not]
    steps += [_conditionals] if conditionals and not pointed & {"if", "then", "else"} else []
    changed = "unevaluatedProperties" not in pointed and rewrite_unevaluated(work, nodes, _nodes)
    for node in nodes:
        for step in steps:
            changed = step(node) | changed
    return work if changed else schema


def _keywords_in(ref: str) -> frozenset[str]:
    """The keywords a JSON pointer passes through (not the names under definitions, properties, ...)."""
    parts = ref.partition("#")[2].split("/")
    return frozenset(p for prev, p in zip(parts, parts[1:]) if prev not in _NAMED)


def _restated(node: dict[str, Any], root: dict[str, Any]) -> bool:
    """Drop the entries of the node's branches' `properties` that restate the node's own or say nothing (exact:
    the value meets the node's `properties` anyway); not in a branch with additionalProperties or
    unevaluatedProperties, where an entry also says which keys are not additional."""
    own = node.get("properties")
    if not isinstance(own, dict):
        return False
    members = [m for m in node["allOf"] if isinstance(m, dict)] if isinstance(node.get("allOf"), list) else []
    branches: list[dict[str, Any]] = list(members)
    for holder in [node, *members]:
        branches += [holder[k] for k in ("if", "then", "else", "not") if isinstance(holder.get(k), dict)]
        for key in ("anyOf", "oneOf"):
            if isinstance(holder.get(key), list):
                branches += [b for b in holder[key] if isinstance(b, dict)]
    changed = False
    for branch in branches:
        props = branch.get("properties")
        if not isinstance(props, dict) or {"additionalProperties", "unevaluatedProperties"} & set(branch):
            continue
        for key in [k for k, v in props.items() if v is True or v == {} or (k in own and _same(v, own[k], root))]:
            del props[key]
            changed = True
        if not props:
            del branch["properties"]
    return changed


def _same(schema: Any, own: Any, root: dict[str, Any]) -> bool:
    """`schema` is `own`, written again or as a `#/...` $ref to it."""
    if schema == own:
        return True
    ref = schema.get("$ref") if isinstance(schema, dict) and set(schema) - _ANNOTATIONS == {"$ref"} else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return False
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node is own


def _format(node: dict[str, Any]) -> bool:
    pattern = FORMATS.get(node["format"]) if isinstance(node.get("format"), str) else None
    if pattern is None:
        return False
    if "pattern" not in node:
        node["pattern"] = pattern
    else:  # llguidance intersects the patterns of an allOf
        node["allOf"] = [*node.get("allOf", []), {"pattern": pattern}]
    if node["format"] in NEW_FORMATS:
        del node["format"]
    return True


def _safe_integer(node: dict[str, Any]) -> bool:
    if node.get("type") != "integer":
        return False

    def given(*keys: str) -> list[float]:
        return [v for k in keys if isinstance(v := node.get(k), (int, float)) and not isinstance(v, bool)]

    lows, highs = given("minimum", "exclusiveMinimum"), given("maximum", "exclusiveMaximum")
    changed = False
    if not lows and "minimum" not in node and all(h >= -SAFE_INTEGER for h in highs):
        node["minimum"] = -SAFE_INTEGER
        changed = True
    if not highs and "maximum" not in node and all(low <= SAFE_INTEGER for low in lows):
        node["maximum"] = SAFE_INTEGER  # a user's bound past the range on the other side: left open
        changed = True
    return changed


def _unique_enum(node: dict[str, Any]) -> bool:
    items = node.get("items")
    if node.get("uniqueItems") is not True or not isinstance(items, dict) or "enum" in node:
        return False
    values = [items["const"]] if "const" in items else items.get("enum")
    if not isinstance(values, list) or len(values) > MAX_UNIQUE or set(node) & _ARRAY_OTHER:
        return False
    low, high = node.get("minItems", 0), node.get("maxItems", len(values))
    if not isinstance(low, int) or not isinstance(high, int):
        return False
    distinct = [v for i, v in enumerate(values) if v not in values[:i]]
    node["enum"] = [
        list(c) for n in range(low, min(high, len(distinct)) + 1) for c in itertools.combinations(distinct, n)
    ]
    del node["uniqueItems"]
    return True


def _one_of(node: dict[str, Any], root: dict[str, Any]) -> bool:
    """oneOf as an anyOf that means the same: branches that no value satisfies together as they are, else each
    branch with the others' negations (negate()) when every branch has one; else narrowed (one_of.narrow)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches or "anyOf" in node:
        return False
    if len(branches) <= MAX_ONE_OF and not all_disjoint(branch_facts(node, root), root):
        negations = [negate(b) for b in branches]
        if all(n is not None for n in negations):
            others = [[n for j, n in enumerate(negations) if j != i] for i in range(len(branches))]
            node["anyOf"] = [{"allOf": [b, *others[i]]} for i, b in enumerate(branches)]
            del node["oneOf"]
            return True
    return narrow(node, root, negate)


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    return None if kinds is None else kinds | ({"integer"} if "number" in kinds else set())


def _not(node: dict[str, Any]) -> bool:
    """A `not` becomes an allOf member of its negation where negate() writes one (llguidance has no `not`):
    `not: {required: [k]}` is an object without k. Run on a node before its `if` child, so affirm() still reads that."""
    if "not" not in node:
        return False
    negated = negate(node["not"])
    if negated is None:
        return False
    del node["not"]
    node["allOf"] = [*(node["allOf"] if isinstance(node.get("allOf"), list) else []), negated]
    return True


def _dependencies(node: dict[str, Any]) -> bool:
    parts = []
    for key in ("dependentRequired", "dependencies", "dependentSchemas"):
        deps = node.get(key)
        if not isinstance(deps, dict):
            continue
        for name, need in deps.items():
            if isinstance(need, list) and all(isinstance(n, str) for n in need):
                need = {"required": need}
            elif not isinstance(need, (dict, bool)) or key == "dependentRequired":
                return False  # malformed: left for lenient mode
            parts.append({"anyOf": [{"properties": {name: False}}, {"allOf": [{"required": [name]}, need]}]})
    if not parts:
        return False
    for key in ("dependentRequired", "dependencies", "dependentSchemas"):
        node.pop(key, None)
    node["allOf"] = [*node.get("allOf", []), *parts]
    return True


def _conditionals(node: dict[str, Any]) -> bool:
    """Rewrite the node's own if/then/else and those of its allOf members (where real schemas keep them):
    those that test one property's value grouped by that property into one anyOf of its values (a switch),
    the others two ways each."""
    members: list[Any] = node["allOf"] if isinstance(node.get("allOf"), list) else []
    holders = [h for h in [node, *members] if isinstance(h, dict) and "if" in h]
    groups: dict[str, list[tuple[dict[str, Any], list[Any]]]] = {}
    for holder in holders:
        found = _discriminator(holder["if"])
        if found is not None:
            groups.setdefault(found[0], []).append((holder, found[1]))
    parts = []
    for key, conds in groups.items():
        switch = _switch(key, [(v, h.get("then", True), h.get("else", True)) for h, v in conds])
        if switch is not None:
            parts.append(switch)
            for holder, _ in conds:
                for k in ("if", "then", "else"):
                    holder.pop(k, None)
    for holder in [h for h in holders if "if" in h][:MAX_CONDITIONALS]:
        negated, cond = negate(holder["if"]), affirm(holder["if"])
        if negated is not None and cond is not None:
            then, other = holder.pop("then", True), holder.pop("else", True)
            del holder["if"]
            parts.append({"anyOf": [{"allOf": [cond, then]}, {"allOf": [negated, other]}]})
    if not parts:
        return False
    node["allOf"] = [*node.get("allOf", []), *parts]  # appended: pointers to the members keep their targets
    return True


def _discriminator(cond: Any) -> tuple[str, list[Any]] | None:
    """(property, values) when `cond` holds exactly for an object whose property has one of the values (or
    lacks it, unless `cond` requires it; the switch leaves that case out)."""
    if not isinstance(cond, dict) or set(cond) - _ANNOTATIONS - {"required"} != {"properties"}:
        return None
    props, required = cond["properties"], cond.get("required", [])
    if not isinstance(props, dict) or len(props) != 1 or not isinstance(required, list):
        return None
    key, sub = next(iter(props.items()))
    if required not in ([], [key]) or not isinstance(sub, dict):
        return None
    keys = set(sub) - _ANNOTATIONS - {"type"}
    values = [sub["const"]] if keys == {"const"} else sub.get("enum") if keys == {"enum"} else None
    if not isinstance(values, list) or not all(isinstance(v, (str, bool)) or v is None for v in values):
        return None
    return key, values


def _switch(key: str, conds: list[tuple[list[Any], Any, Any]]) -> dict[str, Any] | None:
    """One anyOf for conditionals on `key`'s value: each value with the then/else branches it picks, and every
    other value with the else branches. The property is required (an object without it is left out); a value
    that is no object meets every `if` (they test properties only), so it takes every then branch."""
    values: list[Any] = []
    for vals, _, _ in conds:
        values += [v for v in vals if v not in values]
    rest = not_in(values)
    if rest is None or len(values) > MAX_CASES:
        return None
    cases = []
    for value in [*({"const": v} for v in values), rest]:
        picked = [then if "const" in value and value["const"] in vals else other for vals, then, other in conds]
        case: dict[str, Any] = {"type": "object", "required": [key], "properties": {key: value}}
        if any(p is not True for p in picked):
            case["allOf"] = [p for p in picked if p is not True]
        cases.append(case)
    thens = [then for _, then, _ in conds if then is not True]
    if not any(t is False or (isinstance(t, dict) and (_types(t) or {"x"}) <= {"object"}) for t in thens):
        cases.append({"type": ["array", "string", "number", "boolean", "null"], **({"allOf": thens} if thens else {})})
    return {"anyOf": cases}


def affirm(schema: Any) -> Any:
    """`schema` without a `not` on top (llguidance has none), or None when it cannot be written without."""
    if isinstance(schema, dict) and set(schema) - _ANNOTATIONS == {"not"}:
        return negate(schema["not"])
    return schema


def negate(schema: Any) -> Any:
    """A schema of exactly the values `schema` rejects, for the discriminator fragment; None outside it."""
    if isinstance(schema, bool):
        return not schema
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - _ANNOTATIONS
    if not keys:
        return False
    if keys == {"not"}:
        return schema["not"]
    if keys == {"const"}:
        return not_in([schema["const"]])
    if keys == {"enum"} and isinstance(schema["enum"], list):
        return not_in(schema["enum"])
    strings = schema.get("enum") if schema.get("type") == "string" else None
    if keys == {"type", "enum"} and isinstance(strings, list) and all(isinstance(v, str) for v in strings):
        return not_in(strings)  # not a string, or another string: every value but these
    if len(keys) == 1 and keys <= {"anyOf", "allOf"} and isinstance(schema[next(iter(keys))], list):
        key = next(iter(keys))
        parts = [negate(p) for p in schema[key]]
        if any(p is None for p in parts):
            return None
        return {"allOf" if key == "anyOf" else "anyOf": parts}  # De Morgan
    if keys and keys <= {"properties", "required", "type"}:
        return _not_object(schema)
    return None


def _not_object(schema: dict[str, Any]) -> Any:
    kind = schema.get("type", "object")
    props, required = schema.get("properties", {}), schema.get("required", [])
    if kind not in ("object", ["object"]) or not isinstance(props, dict) or not isinstance(required, list):
        return None
    options: list[Any] = [{"type": ["string", "number", "boolean", "null", "array"]}] if "type" in schema else []
    options += [{"type": "object", "properties": {str(k): False}} for k in required]
    for key, sub in props.items():
        negated = negate(sub)
        if negated is None:
            return None
        if negated is not False:
            options.append({"type": "object", "required": [key], "properties": {key: negated}})
    return {"anyOf": options} if options else False


def not_in(values: list[Any]) -> Any:
    """A schema of every JSON value but `values` (scalars); None for numbers, objects or arrays among them."""
    strings = [v for v in values if isinstance(v, str)]
    bools = {v for v in values if isinstance(v, bool)}
    if any(not isinstance(v, (str, bool)) and v is not None for v in values):
        return None
    options: list[Any] = [{"type": [*_OTHER_TYPES, "number"]}]
    options.append({"type": "string", "pattern": f"^{other_strings(strings)}$"} if strings else {"type": "string"})
    if len(bools) < 2:
        options.append({"type": "boolean"} if not bools else {"const": not bools.pop()})
    if None not in values:
        options.append({"type": "null"})
    return {"anyOf": options}


def other_strings(words: list[str]) -> str:
    """A regex (no anchors) of every string but `words`."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return _other(trie)


def _other(node: dict[str, Any]) -> str:
    chars = sorted(k for k in node if k)
    anything = "[\\s\\S]*"
    options = [] if "" in node else [""]
    options.append(f"[^{''.join(_esc(c) for c in chars)}]{anything}" if chars else f"[\\s\\S]{anything}")
    options += [_esc(c) + _other(node[c]) for c in chars]
    return "(?:" + "|".join(options) + ")"


def _esc(ch: str) -> str:
    """One character in a regex, read the same by llguidance's, Python's and ECMA's (within the BMP) syntax."""
    if ch.isalnum() and ch.isascii():
        return ch
    return f"\\u{ord(ch):04X}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08X}"


_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "not",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_BRANCH_KEYS = frozenset({"allOf", "anyOf", "oneOf", "if", "then", "else", "not"})  # a $ref through one: no _restated


def _nodes(schema: Any) -> list[dict[str, Any]]:
    """Every subschema (iterative: decoded nesting can be deep); property names and enum values are no schemas."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.append(node)
        stack.extend(node[k] for k in _ONE if isinstance(node.get(k), dict))
        for key in _MANY:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _NAMED:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return found
