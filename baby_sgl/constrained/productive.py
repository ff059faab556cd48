"""Whether every part of a grammar can produce something, checked before the library sees it.

A Lark rule whose every alternative needs itself first (`a: a "y"`), or a JSON schema that only
refers to itself (`{"$ref": "#"}`, `{"anyOf": [{"$ref": "#"}]}`), never produces any text. The
grammar library refuses such a part with an internal name when it is reached right after a
literal, but reached after a regex lexeme (`start: "x" /\\n+/ a`) its mask computation never
returns: a compile thread, or the scheduler thread once an output gets there, spun at 100% CPU for
good. So each grammar is checked here first, in time linear in its size: a rule is productive when
one of its alternatives needs only productive rules (optional and repeated-from-zero items need
nothing), a schema when it describes a value without a $ref or combinator, or its $ref and allOf
parts are productive and anyOf/oneOf have a productive choice. Only parts reachable from the start
(the rule `start`, the schema's root) are reported. Whether a regex matches any text is asked of
the library itself, on the regex alone (first in its grammar, an empty one is refused, not looped
on). A Lark grammar this reader cannot follow is refused (it reads the syntax llguidance documents:
rules, tokens, literals, regexes, special tokens, groups, repetitions, attributes, %json, %regex,
and %ignore and %import lines; not %lark's nested grammars, %if, or a client's tokens that combine
regexes with & or ~); a JSON schema construct it does not know is taken as productive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

START_RULE = "start"
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_DEFINITIONS = ("$defs", "definitions")

# Lark's lexical units: a comment, a string literal (flag i), a regex literal (flags), a special
# token, a directive, a name, a number, an operator; whitespace apart from newlines is skipped.
_LARK_TOKEN = re.compile(r"""
    (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\]|\\.)+/[imslux]*)
  | (?P<special><\|[^\n|]*\|>|<\[[^\]\n]*\]>)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<alias>->\s*[?!]?_*[A-Za-z][A-Za-z0-9_]*)
  | (?P<name>[?!]?_*[a-z](?:[a-z0-9_]|-(?!>))*|[?!]?_*[A-Z](?:[A-Z0-9_]|-(?!>))*)
  | (?P<number>-?[0-9]+)
  | (?P<newline>\n)
  | (?P<space>[ \t\r]+)
  | (?P<op>\.\.|[:|()\[\]?*+~{},&.=<>@-])
""", re.X)


_BLANKS = re.compile(r"\s*")
_IMPORTED = re.compile(r"[ \t]+[A-Za-z_][\w.]*(?:[ \t]*->[ \t]*\w+|[ \t]*\([\w, \t]*\))?[ \t]*(?=\n|$)")
_IGNORED = re.compile(r"""[ \t]*(?:/(?:[^/\\\n]|\\.)+/[imslux]*|"(?:[^"\\\n]|\\.)*"i?|_*[A-Z][A-Z0-9_]*)[ \t]*(?=\n|$)""")


class _UnknownRef(Exception):
    """A $ref this check cannot follow (another document, a path that is not there)."""


class _Empty(Exception):
    """A regex of the grammar that matches no text (where it is, the library may spin on it)."""


class _Unreadable(Exception):
    """Lark text this reader does not follow: refused, since the library could loop on it."""


def lark_fault(text: str, regex_is_empty: Callable[[str], bool], combined_tokens: bool = False) -> str | None:
    """What in a Lark grammar (an `ebnf` after any conversion) can never produce anything and is
    reachable from its start, or what of it cannot be read, in words for an error; None if nothing.
    regex_is_empty: whether a regex (flags inline) matches no text (GrammarCache asks the library);
    at most MAX_CHECKED_REGEXES distinct regexes are asked about in one grammar. combined_tokens:
    tokens may intersect or negate regexes (the library's & and ~), whose emptiness this check does
    not decide: only in the grammars the server builds itself."""
    try:
        return _lark_fault(text, combined_tokens, _Regexes(regex_is_empty))
    except _Empty as e:
        return f"the regex /{e}/ matches no text"
    except _Unreadable as e:  # what is not checked is not served: the library could loop on it
        return f"this server reads Lark grammars to check them, and could not read this one ({e})"
    except RecursionError:
        return "the grammar's groups or %json are nested too deeply to check"


def schema_fault(schema: Any) -> str | None:
    """What in a JSON schema only leads back to itself, reachable from its root, or which of its
    $refs cannot be followed, in words for an error; None if nothing."""
    try:
        where = unproductive_schema(schema)
    except _UnknownRef as e:
        if str(e).startswith("$id at "):
            return f"the JSON schema sets a {e}: this server does not follow base URIs inside a schema"
        return f"the JSON schema's $ref {str(e)!r} names no part of the schema (only local references are followed)"
    if where is None:
        return None
    return (f"the JSON schema at {where} only leads back to itself through $ref, anyOf, oneOf or allOf: "
            "it never describes a value")


# ---- JSON schemas -----------------------------------------------------------------------------------
def unproductive_schema(root: Any) -> str | None:
    """The JSON pointer ("#", "#/properties/a", ...) of a subschema reachable from root that
    describes no value because it only refers to itself; None when there is none."""
    nodes: list[tuple[str, Any]] = []  # (pointer, subschema) of every schema position, definitions included
    index: dict[int, int] = {}
    stack: list[tuple[str, Any]] = [("#", root)]
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, (dict, bool)) or id(node) in index:
            continue
        index[id(node)] = len(nodes)
        nodes.append((pointer, node))
        if isinstance(node, dict):
            stack.extend(_children(pointer, node, definitions=True))
    names: dict[str, Any] = {}  # $anchor and $id values -> their subschemas
    for pointer, node in nodes:
        if isinstance(node, dict) and node is not root and "$id" in node:
            # a new base URI: the library reads the $refs under it from there
            raise _UnknownRef(f"$id at {pointer}")
        if isinstance(node, dict):
            for key in ("$anchor", "$id", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    names.setdefault("#" + node[key] if key != "$id" else node[key], node)
    # Horn clauses: a node is productive when its `needs` are, and each of its `choices` has one.
    needs: list[list[int]] = [[] for _ in nodes]
    choices: list[list[list[int]]] = [[] for _ in nodes]
    refers: dict[int, int] = {}  # a node with a $ref -> the node it names
    for i, (_, node) in enumerate(nodes):
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(root, ref, names)
            if target is None or id(target) not in index:
                raise _UnknownRef(ref)
            refers[i] = index[id(target)]
            needs[i].append(refers[i])
        for key, group in (("allOf", needs[i]), ("anyOf", None), ("oneOf", None)):
            parts = node.get(key)
            if not isinstance(parts, list) or not parts:
                continue  # an empty anyOf the library names itself
            ids = [index[id(p)] for p in parts if id(p) in index]
            if len(ids) < len(parts):
                continue  # a part this check does not know: taken as productive
            if group is not None:
                group.extend(ids)
            else:
                choices[i].append(ids)
    productive = _solve(needs, choices)
    # Reachable from the root through schema positions and $refs (definitions only through $refs).
    seen, stack_i = {0}, [0] if nodes else []
    while stack_i:
        i = stack_i.pop()
        pointer, node = nodes[i]
        if not productive[i]:
            return pointer
        if not isinstance(node, dict):
            continue
        nexts = [index[id(child)] for _, child in _children(pointer, node, definitions=False) if id(child) in index]
        if i in refers:
            nexts.append(refers[i])
        for j in nexts:
            if j not in seen:
                seen.add(j)
                stack_i.append(j)
    return None


def _children(pointer: str, node: dict, definitions: bool) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key in _SCHEMA_KEYS:
        if isinstance(node.get(key), (dict, bool)):
            out.append((f"{pointer}/{key}", node[key]))
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out.extend((f"{pointer}/{key}/{n}", sub) for n, sub in enumerate(node[key]))
    for key in _SCHEMA_MAPS + (_DEFINITIONS if definitions else ()):
        if isinstance(node.get(key), dict):
            out.extend((f"{pointer}/{key}/{_escape(name)}", sub) for name, sub in node[key].items())
    return out


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _resolve(root: Any, ref: str, names: dict[str, Any]) -> Any:
    """The subschema a $ref names: the root ("", "#"), a JSON pointer ("#/$defs/a", percent-encoded
    or not), an $anchor ("#a") or an $id; None when it names none of them."""
    if ref in ("", "#"):
        return root
    if ref in names:
        return names[ref]
    if not ref.startswith("#/"):
        return None
    node = root
    for part in unquote(ref[2:]).split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _solve(needs: list[list[int]], choices: list[list[list[int]]]) -> list[bool]:
    """Which nodes are productive, by unit propagation: a node waits for each of its needs and for
    one member of each of its choices; linear in the clauses' size."""
    n = len(needs)
    waiting = [len(set(needs[i])) + len(choices[i]) for i in range(n)]
    # who waits on node j: ("need", i) once per distinct need; ("choice", i, c) per choice membership
    watchers: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for i in range(n):
        for j in set(needs[i]):
            watchers[j].append((i, -1))
        for c, members in enumerate(choices[i]):
            for j in set(members):
                watchers[j].append((i, c))
    chosen: list[set[int]] = [set() for _ in range(n)]  # the choices of node i already met
    productive = [False] * n
    ready = [i for i in range(n) if waiting[i] == 0]
    for i in ready:
        productive[i] = True
    while ready:
        j = ready.pop()
        for i, c in watchers[j]:
            if productive[i]:
                continue
            if c >= 0:
                if c in chosen[i]:
                    continue
                chosen[i].add(c)
            waiting[i] -= 1
            if waiting[i] == 0:
                productive[i] = True
                ready.append(i)
    return productive


# ---- regexes -------------------------------------------------------------------------------------
MAX_CHECKED_REGEXES = 256  # distinct regexes in one grammar (the library's check takes ~1-2 ms each)


class _Regexes:
    """Whether each regex of one grammar matches nothing, each distinct one asked once."""

    def __init__(self, is_empty: Callable[[str], bool]) -> None:
        self._is_empty = is_empty
        self._seen: dict[str, bool] = {}

    def empty(self, pattern: str) -> bool:
        if pattern not in self._seen:
            if len(self._seen) >= MAX_CHECKED_REGEXES:
                raise _Unreadable(f"more than {MAX_CHECKED_REGEXES} distinct regexes")
            self._seen[pattern] = self._is_empty(pattern)
        return self._seen[pattern]


# ---- Lark grammars ----------------------------------------------------------------------------------
def _lark_fault(text: str, combined_tokens: bool, regexes: _Regexes) -> str | None:
    rules, schemas = _read_lark(text, combined_tokens, regexes)
    for schema in schemas:  # every %json, wherever it is: a schema part the library would reach
        fault = schema_fault(schema)
        if fault is not None:
            return fault
    if START_RULE not in rules:
        return None
    # Nodes: the rules, their groups, and one per alternative that needs two or more nodes.
    needs: list[list[int]] = []
    choices: list[list[list[int]]] = []
    edges: list[set[int]] = []  # what each rule or group mentions, needed or optional

    def node() -> int:
        needs.append([])
        choices.append([])
        edges.append(set())
        return len(needs) - 1

    of_rule = {name: node() for name in rules}
    pending = [(of_rule[name], alternatives) for name, alternatives in rules.items()]
    nothing = node()  # what a regex that matches no text needs: never met
    choices[nothing] = [[]]
    empty_regexes: dict[int, str] = {}  # the rule or group that holds one -> the regex

    def requirements(owner: int, item: tuple) -> list[int]:
        kind = item[0]
        if kind == "name":
            target = of_rule.get(item[1])  # a token or an unknown name needs nothing
            if target is None:
                return []
            edges[owner].add(target)
            return [target]
        if kind in ("group", "optional"):
            group = node()
            pending.append((group, item[1]))
            edges[owner].add(group)
            return [group] if kind == "group" else []
        if kind == "regex" and regexes.empty(item[1]):
            empty_regexes.setdefault(owner, item[1])
            return [nothing]
        return []  # a literal, a regex, a %json, a special token

    while pending:
        owner, alternatives = pending.pop()
        members: list[int] = []
        free = False  # an alternative that needs nothing: the node is productive as it is
        for alternative in alternatives:  # every one, for what it mentions
            required = [r for item in alternative for r in requirements(owner, item)]
            if not required:
                free = True
            elif len(required) == 1:
                members.append(required[0])
            else:
                both = node()
                needs[both] = required
                members.append(both)
        if not free:
            choices[owner] = [members]
    productive = _solve(needs, choices)
    names = {index: name for name, index in of_rule.items()}
    seen, stack, broken = {of_rule[START_RULE]}, [of_rule[START_RULE]], []
    while stack:
        k = stack.pop()
        if k in empty_regexes:
            return f"the regex /{empty_regexes[k]}/ matches no text"
        if not productive[k] and k in names:
            broken.append(names[k])
        for j in sorted(edges[k] - seen):
            seen.add(j)
            stack.append(j)
    if not broken:
        return None
    broken = [name for name in broken if name != START_RULE] or broken  # start only fails through them
    shown = ", ".join(repr(name) for name in sorted(broken)[:5]) + (", ..." if len(broken) > 5 else "")
    return (f"{'rule' if len(broken) == 1 else 'rules'} {shown} never {'produces' if len(broken) == 1 else 'produce'} "
            "any text: each alternative needs one of them first")


def _read_lark(text: str, combined_tokens: bool, regexes: _Regexes) -> tuple[dict[str, list[list[tuple]]], list[Any]]:
    """The grammar's rules and plain tokens (by name: alternatives of items) and the schemas of its
    %json directives; attributes' regexes that match nothing raise _Empty."""
    units = _tokens(text)
    rules: dict[str, list[list[tuple]]] = {}
    schemas: list[Any] = []
    attribute_regexes: list[str] = []
    starts = [i for i, (kind, _) in enumerate(units) if kind == "name" and _defines(units, i)]
    for n, s in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(units)
        name = units[s][1].lstrip("?!")
        is_rule = name.lstrip("_")[:1].islower()
        colon = s + 1
        while units[colon] != ("op", ":"):  # past the priority (.2) and the attributes ([lazy, stop=/x/])
            if units[colon][0] == "regex":  # an attribute's regex (stop=/.../, suffix=/.../)
                attribute_regexes.append(units[colon][1])
            colon += 1
        body = units[colon + 1:end]
        if not is_rule and _combines_regexes(body):  # & or ~: whether it matches anything is not decided here
            if not combined_tokens:
                raise _Unreadable(f"token {name} combines regexes with & or ~")
            continue
        parsed, stop = _expansions(body, 0, schemas)
        if stop < len(body):
            raise _Unreadable(f"after {'rule' if is_rule else 'token'} {name}")
        rules[name] = parsed
    for pattern in attribute_regexes:
        if regexes.empty(pattern):
            raise _Empty(pattern)
    return rules, schemas


def _combines_regexes(body: list[tuple[str, Any]]) -> bool:
    """Whether a token's body intersects (&) or negates (~ not followed by a count) regexes."""
    return any(unit == ("op", "&") or (unit == ("op", "~") and (k + 1 >= len(body) or body[k + 1][0] != "number"))
               for k, unit in enumerate(body))


def _defines(units: list[tuple[str, Any]], i: int) -> bool:
    """Whether the name at i begins a definition: first on its line, then `:` (after a priority and
    attributes)."""
    if i > 0 and units[i - 1][0] != "newline":
        return False
    j = i + 1
    if j + 1 < len(units) and units[j] == ("op", ".") and units[j + 1][0] == "number":
        j += 2
    if j < len(units) and units[j] == ("op", "["):
        while j < len(units) and units[j] != ("op", "]"):
            j += 1
        j += 1
    return j < len(units) and units[j] == ("op", ":")


def _tokens(text: str) -> list[tuple[str, Any]]:
    units: list[tuple[str, Any]] = []
    pos = 0
    decoder = json.JSONDecoder()
    while pos < len(text):
        m = _LARK_TOKEN.match(text, pos)
        if m is None:
            raise _Unreadable(f"at {pos}")
        kind, value = m.lastgroup or "", m.group()
        pos = m.end()
        if kind in ("comment", "space", "alias"):  # an alias (-> name) renames the tree node only
            continue
        if kind == "special" and value.startswith("<[^"):
            raise _Unreadable(f"a negated token set {value}")  # it may exclude every token
        if kind == "directive":
            if value in ("%json", "%llguidance", "%regex", "%lark"):
                blanks = _BLANKS.match(text, pos)
                start = blanks.end() if blanks else pos
                if value == "%lark":
                    raise _Unreadable("a nested grammar")
                try:
                    data, end = decoder.raw_decode(text, start)
                except ValueError:
                    raise _Unreadable(f"{value} without JSON") from None
                pos = end
                if value == "%llguidance":
                    continue
                units.append(("json" if value == "%json" else "literal", data))
                continue
            if value == "%import":  # a module's names (common.WS), alone on their line
                line = _IMPORTED.match(text, pos)
                if line is None:
                    raise _Unreadable("%import with more than a module's names on its line")
                pos = line.end()
                continue
            if value != "%ignore":  # %if, %declare...: what they bring is not read here
                raise _Unreadable(f"the directive {value}")
            line = _IGNORED.match(text, pos)  # one regex, string or token, then the line's end
            if line is None:
                raise _Unreadable("%ignore with more than one regex, string or token")
            pos = line.end()  # what it ignores between lexemes needs nothing (an empty one compiles and holds)
            continue
        if kind == "regex":
            end = value.rindex("/")
            flags = value[end + 1:]
            units.append(("regex", f"(?{flags}){value[1:end]}" if flags else value[1:end]))
        elif kind in ("string", "special"):
            units.append(("literal", value))
        elif kind == "newline":
            if units and units[-1][0] != "newline":
                units.append(("newline", None))
        else:
            units.append((kind, value))
    return units


def _expansions(units: list[tuple[str, Any]], i: int, schemas: list[Any]) -> tuple[list[list[tuple]], int]:
    """Alternatives separated by `|` (newlines inside a definition are blanks) from units[i], up to
    a closing bracket or the end; returns them and where they stop."""
    alternatives: list[list[tuple]] = [[]]
    while i < len(units):
        kind, value = units[i]
        if kind == "newline":
            i += 1
            continue
        if (kind, value) in (("op", ")"), ("op", "]")):
            break
        if (kind, value) == ("op", "|"):
            alternatives.append([])
            i += 1
            continue
        if (kind, value) in (("op", "("), ("op", "[")):
            inner, i = _expansions(units, i + 1, schemas)
            if i >= len(units) or units[i] != ("op", ")" if value == "(" else "]"):
                raise _Unreadable("an unclosed group")
            i += 1
            item: tuple = ("group", inner) if value == "(" else ("optional", inner)
        elif kind == "name":
            item = ("name", value.lstrip("?!"))
            i += 1
        elif kind == "json":
            schemas.append(value)
            item = ("literal", None)
            i += 1
        elif kind == "literal":
            item = ("literal", None)
            i += 1
            if i + 1 < len(units) and units[i] == ("op", "..") and units[i + 1][0] == "literal":
                i += 2  # a range of characters, "a".."z"
        elif kind == "regex":
            item = ("regex", value)
            i += 1
        else:
            raise _Unreadable(f"{value!r}")
        i, item = _postfix(units, i, item)
        alternatives[-1].append(item)
    return alternatives, i


def _postfix(units: list[tuple[str, Any]], i: int, item: tuple) -> tuple[int, tuple]:
    """Applies `?`, `*`, `+`, `~ n`, `~ n..m` and `{n}` / `{n,m}` after an item: one that may be
    repeated zero times needs nothing."""
    while i < len(units) and units[i][0] == "op":
        op = units[i][1]
        if op in ("?", "*"):
            item, i = ("optional", [[item]]), i + 1
        elif op == "+":
            i += 1
        elif op == "~" and i + 1 < len(units) and units[i + 1][0] == "number":
            if int(units[i + 1][1]) == 0:
                item = ("optional", [[item]])
            i += 2
            if i + 1 < len(units) and units[i] == ("op", "..") and units[i + 1][0] == "number":
                i += 2
        elif op == "{":
            j = i + 1
            if j < len(units) and units[j][0] == "number" and int(units[j][1]) == 0:
                item = ("optional", [[item]])
            while j < len(units) and units[j] != ("op", "}"):
                j += 1
            i = j + 1
        else:
            break
    return i, item
