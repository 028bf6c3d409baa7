"""The module-level import graph of ``dart_jax`` has no cycle, and no module hides
one behind an import inside a function."""

import ast
import pathlib

import dart_jax

PACKAGE_DIR = pathlib.Path(dart_jax.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
  return {_module_name(p): ast.parse(p.read_text(encoding="utf-8"), str(p))
          for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
  """The dart_jax modules an import statement needs: ``from a import b`` needs
  ``a.b`` when that is a module, else ``a`` (whose ``__init__`` defines ``b``).
  The parent packages Python imports first are left out: every import of a
  submodule has them."""
  names = set()
  if isinstance(node, ast.Import):
    names = {alias.name for alias in node.names}
  elif isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:
      anchor = module.split(".")
      anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
      base = ".".join(anchor + ([base] if base else []))
    names = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
             for alias in node.names}
  return {n for n in names if n in known and n != module}


def _graph() -> tuple[dict[str, set[str]], list[str]]:
  """-> (module-level edges, "module: name" of every import inside a function)."""
  modules = _modules()
  known = set(modules)
  packages = {_module_name(p) for p in PACKAGE_DIR.rglob("__init__.py")}
  edges, nested = {}, []
  for name, tree in modules.items():
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    edges[name] = set().union(*(_imported(n, name, name in packages, known) for n in top))
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
          for target in _imported(node, name, name in packages, known):
            nested.append(f"{name}: {target} (in {fn.name})")
  return edges, nested


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}  # 1 = on the stack, 2 = done
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(edges.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(edges):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_no_import_cycle_among_dart_jax_modules():
  edges, _ = _graph()
  assert len(edges) > 40 and edges["dart_jax.decode.round"], "the walk found no modules"
  assert _find_cycle(edges) is None, " -> ".join(_find_cycle(edges))


def test_no_dart_jax_module_is_imported_inside_a_function():
  _, nested = _graph()
  assert not nested, nested


def test_the_cycle_finder_finds_a_cycle():
  edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _find_cycle(edges) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None
