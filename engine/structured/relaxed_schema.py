"""Best effort for a JSON schema (OpenAI's json_schema without `strict`, vLLM's structured_outputs.json, tool
parameters): enforce everything llguidance can, treat the rest as annotations, and name what was left out.

llguidance's own lenient mode (x-guidance `lenient` + `coerce_one_of`) ignores keywords it does not implement
(uniqueItems, not, if/then/else, propertyNames, dependencies, ...), unknown formats and open-key
min/maxProperties, and compiles oneOf as anyOf; it says so in its warnings, which become the relaxed keywords.
What it still refuses is repaired here, a few rounds at most: a pattern whose regex it cannot read (look-around,
back-references) is dropped, and a $ref it cannot resolve (another document, a missing pointer) matches anything.
Anything else (an invalid schema, an unsatisfiable one, one over the limits) stays an error.

No torch: the API server runs this for its 400s (server/structured/constraint.py), off its event loop.
"""

from __future__ import annotations

import copy
import json
import re
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from engine.structured.closed_counts import closed_counts
from engine.structured.grammar import LIMITS, GrammarError
from engine.structured.json_pointer import MISSING, walk
from engine.structured.ref_intersections import distribute_siblings, unshadow_properties
from engine.structured.schema_ids import drop_plain_ids, ids_are_keywords
from engine.structured.strict_schema import rewrite

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

BEST_EFFORT: dict[str, Any] = {"lenient": True, "coerce_one_of": True}
MAX_REPAIRS = 8  # rounds of "compile, repair what the message names"
FLOAT_BOUND = 1e18  # the widest bound llguidance writes a float range's regex for (1e19 fails)
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_FORMAT = re.compile(r"Unknown format: (\S+)")
_POINTER = re.compile(r"Pointer '([^']*)' does not exist")
_INCOMPATIBLE = re.compile(r"Unsatisfiable schema: incompatible types\s+while processing \S*#(/\S+)")
_RESOURCE = re.compile(r"Resource '([^']*)' is not present")
_NOT_DISJOINT = re.compile(r"patternProperty regexes /(.*)/ and /(.*)/ are not disjoint")
_COUNTS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
# keywords that only annotate: beside a $ref they change nothing, so dropping them there is exact
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "markdownDescription",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "deprecationMessage",
        "errorMessage",
        "x-intellij-html-description",
    }
)


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_KEEP = frozenset({"$ref", "definitions", "$defs", "$schema", "$id", "id", "x-guidance"})  # no constraints


@dataclass(frozen=True, slots=True)
class Relaxed:
    schema: Any  # what to compile: the input itself when it compiles as it is, else a rewritten copy
    keywords: tuple[str, ...]  # what the grammar does not enforce, sorted ("oneOf", "format:url", "$ref", ...)


def with_best_effort(schema: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy whose x-guidance asks for llguidance's lenient mode (the user's own options kept)."""
    options = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(options if isinstance(options, dict) else {}), **BEST_EFFORT}}


def relax(schema: dict[str, Any], style: JsonCompileOptions) -> Relaxed:
    """The schema as llguidance can enforce it, and what it leaves out; GrammarError when not even that works.

    The exact rewrites (engine/structured/strict_schema.py) and repairs first; where llguidance cannot take their result
    (too large, intersections too deep), those without the conditionals', then the schema as it came, then without
    folding recursive refs' siblings into copies."""
    starts: list[dict[str, Any]] = []
    for start in (rewrite(schema), rewrite(schema, conditionals=False), schema):
        if start not in starts:
            starts.append(start)
    for fold in (True, False):
        for start in starts:
            try:
                return _relax(schema, start, style, fold)
            except GrammarError as e:
                error = e
    raise error


def _relax(schema: dict[str, Any], start: dict[str, Any], style: JsonCompileOptions, fold: bool = True) -> Relaxed:
    work = with_best_effort(start)
    repaired: set[str] = set()
    rewritten = start is not schema
    for _ in range(MAX_REPAIRS + 1):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(work), defaults=style)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS)
        if not failed:
            keywords = repaired | {k for m in messages for k in warning_keywords(m)}
            return Relaxed(work if keywords or rewritten else schema, tuple(sorted(keywords)))
        error = messages[0] if messages else "the schema cannot be compiled"
        fixed = _repair(work, error, fold)
        if fixed is None:
            raise GrammarError(error.strip())
        work, keyword = fixed
        rewritten = True
        if keyword is not None:
            repaired.add(keyword)
    raise GrammarError(error.strip())


def warning_keywords(message: str) -> list[str]:
    """The keywords one llguidance warning says were not enforced."""
    found = _UNIMPLEMENTED.search(message)
    if found:
        try:
            return [str(k) for k in json.loads(found.group(1))]
        except ValueError:
            return ["unimplemented"]
    found = _FORMAT.search(message)
    if found:
        return [f"format:{found.group(1)}"]
    if message.startswith("oneOf"):
        return ["oneOf"]
    if "min/maxProperties" in message:
        return ["minProperties/maxProperties"]
    return [re.sub(r"[^A-Za-z0-9 _/:.$-]", "", message)[:60].strip() or "other"]


def _repair(schema: dict[str, Any], error: str, fold: bool = True) -> tuple[dict[str, Any], str | None] | None:
    """A copy of the schema without what `error` names and the keyword relaxed (None: an exact rewrite), or None
    when it cannot be repaired."""
    work = copy.deepcopy(schema)
    if "Expected positive integer" in error:  # 1.0 is an integer to JSON Schema, not to llguidance
        return (work, None) if _integral_counts(work) else None
    if "Invalid URI reference" in error:  # `<`, spaces, ... in a $ref: written as the URI they stand for
        return (work, None) if _quote_refs(work) else None
    disjoint = _NOT_DISJOINT.search(error)
    if disjoint is not None:
        return (work, "patternProperties") if _drop_overlap(work, disjoint.group(2)) else None
    if "regex for float range" in error:  # a bound past ~1e19: llguidance cannot write the range's regex
        return (work, None) if _narrow_float_bounds(work) else None
    if "regex" in error or "look-around" in error or "backreference" in error.lower():
        return (work, "pattern") if _drop_bad_patterns(work) else None
    if "circular references with sibling keys" in error:
        return _circular(work, "#" + error.rpartition("#")[2].strip(), fold)
    if "minProperties" in error or "maxProperties" in error:  # llguidance counts required keys only
        return (work, None) if closed_counts(_nodes(work)) else None
    unsatisfiable = _INCOMPATIBLE.search(error)
    if unsatisfiable is not None:  # a subschema no value meets (`type: object` and a oneOf of strings) is `false`
        return (work, None) if _falsify(work, unsatisfiable.group(1)) else None
    pointer, resource = _POINTER.search(error), _RESOURCE.search(error)
    if pointer is None and resource is None:
        return None
    if resource is not None and not ids_are_keywords(work) and drop_plain_ids(work):
        return work, None  # an `id` llguidance took for a base URI where it is no keyword
    if resource is not None and str(work.get("$schema", "")).rstrip("#") == resource.group(1):
        del work["$schema"]  # a dialect llguidance does not know: read as the default draft
        return work, None
    return (work, "$ref") if _drop_unresolvable_refs(work) else None


def _circular(work: dict[str, Any], target: str, fold: bool) -> tuple[dict[str, Any], str | None] | None:
    """llguidance cannot intersect a recursive $ref with other keywords: annotations beside a $ref go (exact), in
    drafts 3 to 7 all that sits beside a $ref to `target` (exact), else what sits beside one (in its node or its
    allOf) goes."""
    if _strip_ref_siblings(work, only_annotations=True):
        return work, None
    if _ref_siblings_ignored(work) and _strip_ref_siblings(work, only_annotations=False, target=target):
        return work, None  # drafts 3 to 7 ignore them, as the output check (jsonschema) does
    if fold and _fold(work, target):
        return work, None
    if fold and (unshadow_properties(_nodes(work)) or distribute_siblings(_nodes(work), target, _KEEP | ANNOTATIONS)):
        return work, None  # exact: the next round folds the allOf it left
    if _strip_ref_siblings(work, only_annotations=False, target=target):
        return work, "$ref"
    dropped = False
    for node in _nodes(work):
        parts = node.get("allOf")
        if isinstance(parts, list) and any(isinstance(p, dict) and p.get("$ref") == target for p in parts):
            node["allOf"] = [p for p in parts if not (isinstance(p, dict) and p.get("$ref") == target)]
            if not node["allOf"]:
                del node["allOf"]
            dropped = True
    return (work, "allOf") if dropped else None


def _ref_siblings_ignored(work: dict[str, Any]) -> bool:
    """Drafts 3 to 7: every keyword beside a $ref is ignored, so dropping them there is exact."""
    dialect = work.get("$schema")
    return isinstance(dialect, str) and any(f"json-schema.org/draft-0{n}/" in dialect for n in (3, 4, 6, 7))


def _fold(work: dict[str, Any], target: str) -> bool:
    """Exact: `{"$ref": T, ...siblings}` (or an allOf of a $ref to T and other members) becomes a $ref to a copy of
    T's definition that holds the siblings in its allOf, beside T: llguidance then meets no recursive $ref with
    siblings there (the copy refers to T itself only inside). Once per node; not where T is only a $ref."""
    parent, _, name = target.partition("#")[2].rpartition("/")
    container = _resolve(work, parent)
    body = container.get(name) if isinstance(container, dict) else None
    if not isinstance(body, dict) or {"$id", "id", "$anchor", "$dynamicAnchor"} & set(body):
        return False  # a copy of an id or anchor would be a second resource of that name
    if not set(body) - {"$ref"} - ANNOTATIONS:
        return False  # only a $ref: the copy would meet the same recursion with siblings
    folded = 0
    for node in _nodes(work):
        extra = {k: v for k, v in node.items() if k not in _KEEP and k not in ANNOTATIONS}
        parts = node.get("allOf")
        if node.get("$ref") == target and extra:
            siblings = [extra]
        elif isinstance(parts, list) and {"$ref": target} in parts and len(parts) > 1 and set(extra) == {"allOf"}:
            siblings = [p for p in parts if p != {"$ref": target}]
        else:
            continue
        folded += 1
        copy_name = next(n for i in range(len(container) + 1) if (n := f"{name}__with{i}") not in container)
        container[copy_name] = {**body, "allOf": [*body.get("allOf", []), *siblings]}
        for key in extra:
            del node[key]
        node["$ref"] = f"#{parent}/{copy_name}"
    return folded > 0


def _resolve(root: Any, pointer: str) -> Any:
    node = root
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _quote_refs(schema: Any) -> bool:
    changed = False
    for node in _nodes(schema):
        ref = node.get("$ref")
        if isinstance(ref, str):
            quoted = urllib.parse.quote(ref, safe="/#:@!$&'()*+,;=?~-._%")
            changed = changed or quoted != ref
            node["$ref"] = quoted
    return changed


def _integral_counts(schema: Any) -> bool:
    changed = False
    for node in _nodes(schema):
        for key in _COUNTS:
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = int(value)
                changed = True
    return changed


def _drop_overlap(schema: Any, pattern: str) -> bool:
    """Drop one of two overlapping patternProperties (llguidance needs them disjoint)."""
    for node in _nodes(schema):
        props = node.get("patternProperties")
        if isinstance(props, dict) and pattern in props and len(props) > 1:
            del props[pattern]
            return True
    return False


def _strip_ref_siblings(schema: Any, *, only_annotations: bool, target: str | None = None) -> bool:
    """Drop what sits beside a $ref (to `target` only, when given): annotations, or every keyword but the
    document's own (its definitions, dialect, id)."""
    changed = False
    for node in _nodes(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and len(node) > 1 and target in (None, ref):
            extra = [k for k in node if k not in _KEEP and (k in ANNOTATIONS or not only_annotations)]
            for key in extra:
                del node[key]
            changed = changed or bool(extra)
    return changed


def _pointer(root: Any, fragment: str) -> bool:
    """The JSON pointer `fragment` resolves in `root`."""
    return walk(root, fragment.split("/")[1:]) is not MISSING


def _drop_unresolvable_refs(schema: dict[str, Any]) -> bool:
    """Every $ref that resolves neither in this document nor in a resource it embeds goes: an optional property
    or array item it stood for is left out (`false`: the output never reaches the unknown schema), anywhere else
    it matches anything."""
    nodes = _nodes(schema)
    ids = {str(n.get(k)).rstrip("#") for n in nodes for k in ("$id", "id") if isinstance(n.get(k), str)}
    lost = [n for n in nodes if isinstance(n.get("$ref"), str) and not _resolves(schema, ids, n["$ref"])]
    if not lost:
        return False
    gone = {id(n) for n in lost}
    for node in nodes:
        props, required = node.get("properties"), node.get("required")
        if isinstance(props, dict):
            for key in [k for k, v in props.items() if id(v) in gone]:
                if not (isinstance(required, list) and key in required):
                    props[key] = False
        items = node.get("items")
        if id(items) in gone and not node.get("minItems"):
            node["items"] = False
    for node in lost:
        node.pop("$ref", None)  # its siblings (a description, a type) still apply where it stays
    return True


def _resolves(schema: dict[str, Any], ids: set[str], ref: str) -> bool:
    doc, _, fragment = ref.partition("#")
    own = not doc or doc.rstrip("/") in ids or any(i.endswith("/" + doc.removeprefix("./")) for i in ids)
    return own and (not fragment.startswith("/") or _pointer(schema, fragment) or bool(doc))


def _nodes(schema: Any) -> list[dict[str, Any]]:
    """Every object in the schema document (iterative: decoded nesting can be deep)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.append(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def regex_ok(pattern: str) -> bool:
    """llguidance can compile this JSON Schema `pattern`."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
    return not llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)


def _drop_bad_patterns(schema: Any) -> bool:
    dropped = False
    for node in _nodes(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not regex_ok(pattern):
            del node["pattern"]
            dropped = True
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in [k for k in props if not regex_ok(k)]:
                del props[key]
                dropped = True
    return dropped


def _narrow_float_bounds(schema: Any) -> bool:
    """A numeric bound past +-FLOAT_BOUND becomes +-FLOAT_BOUND (of the same kind, inclusive or exclusive) where
    the other side allows it: fewer values, each one valid, instead of a refusal (llguidance cannot write the
    regex of a range that wide)."""
    changed = False
    for node in _nodes(schema):
        bounds = {
            k: v for k, v in node.items() if k in _BOUNDS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        lows = {k: v for k, v in bounds.items() if k.endswith("inimum")}
        highs = {k: v for k, v in bounds.items() if k.endswith("aximum")}
        for near, far, sign in ((lows, highs, 1), (highs, lows, -1)):
            past = [k for k, v in far.items() if sign * v > FLOAT_BOUND]
            if past and all(sign * v < FLOAT_BOUND for v in near.values()):
                node.update({k: sign * FLOAT_BOUND for k in past})
                changed = True
    return changed


def _falsify(schema: dict[str, Any], pointer: str) -> bool:
    """Every `$ref` to the subschema at `pointer` (and it, unless a definition: llguidance refuses a reference to
    `false`) becomes `false`: exact where no value meets that subschema."""
    target, changed = "#" + pointer, False
    for node in [schema, *_containers(schema)]:
        keys = range(len(node)) if isinstance(node, list) else list(node)
        for key in keys:
            child = node[key]
            if isinstance(child, dict) and child.get("$ref") == target:
                node[key] = False
                changed = True
    parent, _, name = pointer.rpartition("/")
    container = _resolve(schema, parent) if parent not in ("", "/definitions", "/$defs") else None
    if isinstance(container, dict) and isinstance(container.get(name), dict):
        container[name] = False
        changed = True
    return changed


def _containers(schema: Any) -> list[Any]:
    """Every object and array in the document."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                found.append(child)
                stack.append(child)
    return found
