"""
nanoGPT-style configuration: a script defines its config as plain globals, then calls

    configurator.configure(globals(), sys.argv[1:])

A bare argument is a config file exec'd into those globals; `--key=value` overrides one global, parsed with
ast.literal_eval (where the global is a string, the text as written unless it is a quoted string) and must keep the
global's type (None only where the default is None).
Unknown keys (on the command line or assigned in a config file) are refused with the closest valid key, so a
typo never silently trains with a default. Errors are one line: `configure_or_exit` prints it and exits 2.
"""

import ast
import difflib
import os
import sys


class ConfigError(Exception):
    pass


def config_keys(g):
    """The globals that count as config: plain values, not modules, functions, classes or _private names."""
    return {k for k, v in g.items() if not k.startswith("_") and isinstance(v, (int, float, str, bool, list, tuple, dict, type(None)))}


def closest(key, keys):
    m = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.5)
    return f"; did you mean '{m[0]}'?" if m else ""


def coerce(key, value, old):
    """Check that `value` may replace `old` (same type; an int may stand for a float; a None default takes anything)."""
    if old is None:
        return value
    if value is None:  # --seq_len=None would fail later as an unexpected TypeError (exit 10: restarted)
        raise ConfigError(f"{key} must be a {type(old).__name__} (default {old!r}), got None")
    if isinstance(old, bool) or isinstance(value, bool):
        if isinstance(old, bool) and isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be True or False, got {value!r}")
    if isinstance(old, float) and isinstance(value, int):
        return float(value)
    if isinstance(old, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(old)(value)
    if type(value) is not type(old):
        raise ConfigError(f"{key} must be a {type(old).__name__} (default {old!r}), got {type(value).__name__} {value!r}")
    return value


def parse_value(key, text, old):
    if isinstance(old, str):  # a string key takes the text as written (--out_dir=2024), or a quoted literal's string
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
        if value is None:
            raise ConfigError(f"--{key}=None: {key} is a string; pass --{key}= for an empty one")
        return value if isinstance(value, str) else text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if isinstance(old, str) or old is None:
            return text  # --device=cuda: a bare word is a string
        raise ConfigError(f"--{key}={text}: not a valid Python literal for a {type(old).__name__}")


def exec_config_file(path, g):
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} not found; pass a file under config/ or --key=value overrides")
    before = config_keys(g)
    scope = dict(g)
    try:
        src = open(path).read()
        exec(compile(src, path, "exec"), scope)
    except SyntaxError as e:
        raise ConfigError(f"{path}:{e.lineno}: syntax error: {e.msg}")
    except Exception as e:
        raise ConfigError(f"{path}: raised {type(e).__name__}: {e}")
    for k in config_keys(scope) - before:
        if k not in g and k != "__builtins__":
            raise ConfigError(f"{path}: unknown config key '{k}'{closest(k, before)}")
    for k in before:
        if scope.get(k) is not g[k]:
            g[k] = coerce(k, scope[k], g[k])


DATA_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.UAdd, ast.USub)


def not_data(text):
    """None if a config file's text is plain data (assignments of literals, arithmetic, names, dict(...); a power only
    of a literal to a literal of at most 64, no repeated strings or lists: nothing that takes long to compute), else
    (line, what): a file from another machine (relay's config.py) is exec'd by train.py, so it may hold no code."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        return e.lineno or 0, f"syntax error: {e.msg}"

    def bad(node):
        if isinstance(node, (ast.Constant, ast.Name)):
            return None
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return next(filter(None, map(bad, node.elts)), None)
        if isinstance(node, ast.Dict):
            return next(filter(None, map(bad, [k for k in node.keys if k is not None] + node.values)), None) \
                if None not in node.keys else node
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, DATA_OPS):
            return bad(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):  # 9**9**9 would hang: a literal ** a small one
            e = node.right.operand if isinstance(node.right, ast.UnaryOp) else node.right
            if not (isinstance(node.left, ast.Constant) and isinstance(e, ast.Constant)
                    and isinstance(e.value, (int, float)) and abs(e.value) <= 64):
                return node
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)  # "x" * 10**12 would fill memory
                and any(isinstance(s, (ast.List, ast.Tuple, ast.Set)) or isinstance(s, ast.Constant)
                        and isinstance(s.value, (str, bytes)) for s in (node.left, node.right))):
            return node
        if isinstance(node, ast.BinOp) and isinstance(node.op, DATA_OPS):
            return bad(node.left) or bad(node.right)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return next(filter(None, (bad(k.value) for k in node.keywords)), None)
        return node
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            node = bad(stmt.value)
            if node is None:
                continue
            return node.lineno, ast.unparse(node)[:60]
        return stmt.lineno, ast.unparse(stmt).splitlines()[0][:60]
    return None


def configure(g, argv):
    """Apply config files and --key=value overrides from argv to the globals dict g; returns the keys set."""
    keys = config_keys(g)
    changed = []
    for arg in argv:
        if not arg.startswith("--"):
            exec_config_file(arg, g)
            changed.append(arg)
            continue
        if "=" not in arg:
            raise ConfigError(f"{arg}: overrides are written --key=value")
        key, text = arg[2:].split("=", 1)
        if key not in keys:
            raise ConfigError(f"unknown config key '{key}'{closest(key, keys)}")
        g[key] = coerce(key, parse_value(key, text, g[key]), g[key])
        changed.append(key)
    return changed


def configure_or_exit(g, argv, prog=None):
    try:
        return configure(g, argv)
    except ConfigError as e:
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        sys.exit(2)


def help_text(g, doc, prog):
    lines = [doc.strip(), "", f"usage: python {prog} [config/FILE.py ...] [--key=value ...]", "", "config keys (defaults):"]
    for k in sorted(config_keys(g)):
        lines.append(f"  --{k}={g[k]!r}")
    return "\n".join(lines)
