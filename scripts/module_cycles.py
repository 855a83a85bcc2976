#!/usr/bin/env python3
"""Checks that no crate's modules import each other in a circle.

The graph is made of the `crate::…` and `super::…` paths in each source file
(comments left out), resolved to the module files that exist, between
sibling modules: an edge a → b where a file under module a names module b
(or something under it). A module and its own children do not count (a
child's `use super::*` is how a folder module shares its items). Every
strongly connected set of more than one module is a circle. Run by
scripts/test.sh; prints the circles it finds and exits 1.

Usage: scripts/module_cycles.py [CRATE_DIR...]   (default: every crate in the workspace)
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["proto", "gateway", "client", "gateway/fuzz", "enclave-stage"]
PATH = re.compile(r"\b(crate|super)((?:::(?:super|[a-z_][a-z0-9_]*))+)")


def modules(src):
    """Module path (tuple) -> file, for every .rs file under `src`."""
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                p = os.path.join(root, f)
                rel = os.path.relpath(p, src)[:-3].split(os.sep)
                if rel[-1] in ("mod", "lib", "main"):
                    rel = rel[:-1]
                out[tuple(rel)] = p
    return out


def referenced(path, me, known):
    """The modules a file names through `crate::` and `super::` paths."""
    text = re.sub(r"//[^\n]*", "", open(path, encoding="utf-8").read())
    out = set()
    for m in PATH.finditer(text):
        cur = [] if m.group(1) == "crate" else list(me[:-1])
        for part in m.group(2).split("::")[1:]:
            if part == "super":
                cur = cur[:-1]
            elif tuple(cur + [part]) in known:
                cur.append(part)
            else:
                break
        out.add(tuple(cur))
    return out


def circles(crate):
    known = modules(os.path.join(ROOT, crate, "src"))
    edges = {}
    for me, path in known.items():
        for to in referenced(path, me, known):
            i = 0
            while i < min(len(me), len(to)) and me[i] == to[i]:
                i += 1
            if i in (len(me), len(to)):
                continue  # the same module, an ancestor or a descendant
            edges.setdefault(me[: i + 1], set()).add(to[: i + 1])
    # Tarjan's strongly connected components.
    index, low, stack, on, found, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found, edges


def main():
    bad = 0
    for crate in sys.argv[1:] or CRATES:
        found, edges = circles(crate)
        for comp in found:
            bad += 1
            print(f"{crate}: modules in a circle: {', '.join('::'.join(m) for m in comp)}")
            for a in comp:
                for b in sorted(edges.get(a, ())):
                    if b in comp:
                        print(f"    {'::'.join(a)} -> {'::'.join(b)}")
    if bad:
        sys.exit(1)
    print(f"no module circle in {', '.join(sys.argv[1:] or CRATES)}")


if __name__ == "__main__":
    main()
