"""No import circles: the project's import graph, read from every .py file with `ast` (imports
inside functions count too: they run the same module), has no cycle. In a circle one module
runs with the other half-initialised, and the files can no longer be read one below the other
(model.py -> residuals.py, never back)."""

import ast
from pathlib import Path

import networkx as nx  # a dependency of torch

ROOT = Path(__file__).resolve().parents[1]


def module_files(root):
    """{dotted module name: path} of every .py file under root (packages found by walking, not
    listed): a/b.py -> 'a.b', a/__init__.py -> 'a'. Hidden and cache folders are skipped."""
    out = {}
    for path in sorted(root.rglob('*.py')):
        rel = path.relative_to(root)
        if any(p.startswith('.') or p == '__pycache__' for p in rel.parts):
            continue
        parts = list(rel.with_suffix('').parts)
        if parts[-1] == '__init__':
            parts = parts[:-1]
        out['.'.join(parts)] = path
    return out


def imported(node, name, is_package, known):
    """The project modules an Import / ImportFrom node of module `name` loads: the named module
    and every package above it (Python runs a package's __init__ before its submodules)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ''
        if node.level:  # from . import x / from ..a import b
            pkg = name.split('.') if is_package else name.split('.')[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = '.'.join(pkg + ([base] if base else []))
        targets = [f"{base}.{a.name}" if base else a.name for a in node.names] + [base]
    out = set()
    for t in targets:
        parts = t.split('.')
        for i in range(1, len(parts) + 1):
            if '.'.join(parts[:i]) in known:
                out.add('.'.join(parts[:i]))
    return out


def import_graph(root):
    files = module_files(root)
    g = nx.DiGraph()
    g.add_nodes_from(files)
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, name, path.name == '__init__.py', files):
                    if target != name:
                        g.add_edge(name, target)
    return g


def cycles(g):
    """One cycle (a list of module names, the first repeated at the end) per strongly
    connected group of modules."""
    out = []
    for group in nx.strongly_connected_components(g):
        if len(group) > 1:
            edges = nx.find_cycle(g.subgraph(group))
            out.append([a for a, _ in edges] + [edges[0][0]])
    return out


def test_the_graph_sees_the_project():
    g = import_graph(ROOT)
    # the packages are found by walking and their imports resolved, lazy ones included
    assert {'model', 'residuals', 'fast', 'fast.streams', 'probes.analysis', 'study.sweep'} <= set(g)
    assert g.has_edge('probe', 'probes.analysis') and g.has_edge('model', 'residuals')
    assert g.has_edge('study.mini', 'study.families')


def test_a_planted_circle_is_named(tmp_path):
    (tmp_path / 'pkg').mkdir()
    (tmp_path / 'pkg' / '__init__.py').write_text('')
    (tmp_path / 'top.py').write_text('from pkg import low\n')
    (tmp_path / 'pkg' / 'low.py').write_text('def f():\n    import top  # a lazy import is a circle too\n')
    (tmp_path / 'pkg' / 'side.py').write_text('from . import low\n')
    found = cycles(import_graph(tmp_path))
    assert len(found) == 1 and set(found[0]) == {'top', 'pkg.low'}


def test_no_import_circles():
    found = cycles(import_graph(ROOT))
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)
