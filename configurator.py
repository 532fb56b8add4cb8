"""
nanoGPT-style configuration: a script defines its config as plain globals, then calls

    configurator.configure(globals(), sys.argv[1:])

A bare argument is a config file exec'd into those globals; `--key=value` overrides one global, parsed with
ast.literal_eval (where the global is a string, the text as written unless it is a quoted string) and must keep the
global's type (None only where the default is None).
Arguments apply in order, as in nanoGPT; an override given before a config file that sets the same key is refused
(the file's value would silently replace it). A dict override updates the dict it is given over, entry by entry
(--lr_mult="{'new': 2.0}" keeps a config file's 'old'); a config file's assignment replaces the dict, as Python does.
Unknown keys (on the command line or assigned in a config file) are refused with the closest valid key, so a
typo never silently trains with a default. Errors are one line: `configure_or_exit` prints it and exits 2.
"""

import ast
import copy
import difflib
import operator
import os
import sys


class ConfigError(Exception):
    pass


PLAIN_VALUES = (int, float, complex, str, bytes, bool, list, tuple, set, frozenset, dict, type(None))


def config_keys(g):
    """The globals that count as config: plain values (a misspelt key set to a {set}, 1j or b'' was ignored, unsaid),
    not modules, functions, classes or _private names."""
    return {k for k, v in g.items() if not k.startswith("_") and isinstance(v, PLAIN_VALUES)}


def closest(key, keys):
    m = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.5)
    return f"; did you mean '{m[0]}'?" if m else ""


def kind(value):
    name = type(value).__name__
    return ("an " if name[0] in "aeiou" else "a ") + name


def coerce(key, value, old):
    """Check that `value` may replace `old` (same type; an int may stand for a float; a None default takes anything)."""
    if old is None:
        return value
    if value is None:  # --seq_len=None would fail later as an unexpected TypeError (exit 10: restarted)
        raise ConfigError(f"{key} must be {kind(old)} (default {old!r}), got None")
    if isinstance(old, bool) or isinstance(value, bool):
        if isinstance(old, bool) and isinstance(value, bool):
            return value
        if isinstance(old, bool):
            raise ConfigError(f"{key} must be True or False, got {value!r}")
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(old, (list, tuple)) and isinstance(value, (list, tuple)):
        if isinstance(old, tuple) and old and len(value) != len(old):
            raise ConfigError(f"{key} must hold {len(old)} items (default {old!r}), got {value!r}")
        kinds = {type(v) for v in old}  # a default of one kind of item (betas): each new item must be of that kind
        if len(kinds) == 1:
            return type(old)(coerce(f"{key}[{i}]", v, old[0]) for i, v in enumerate(value))
        return type(old)(value)
    if isinstance(old, dict) and isinstance(value, dict) and len({type(v) for v in old.values()}) == 1:
        sample = next(iter(old.values()))  # lr_mult: every value a float, as the default's
        return {k: coerce(f"{key}[{k!r}]", v, sample) for k, v in value.items()}
    if type(value) is not type(old):
        raise ConfigError(f"{key} must be {kind(old)} (default {old!r}), got {type(value).__name__} {value!r}")
    return value


def parse_value(key, text, old):
    if isinstance(old, bool) and text.strip() not in ("True", "False"):  # --compile=true: it said only 'not a valid Python literal'
        raise ConfigError(f"--{key}={text}: {key} must be True or False")
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
        shown = text if text.isprintable() else repr(text)  # one line, whatever was pasted
        raise ConfigError(f"--{key}={shown}: not a valid Python literal for {kind(old)}")


def exec_file(path, scope):
    """Exec a config file into scope; whatever goes wrong is one ConfigError line naming the file (container.py's
    --random-config reads config files this way too)."""
    try:
        src = open(path, encoding="utf-8").read()
        exec(compile(src, path, "exec"), scope)
    except SyntaxError as e:  # (a NUL byte has no line: it said "FILE:None:")
        raise ConfigError(f"{path}{f':{e.lineno}' if e.lineno else ''}: syntax error: {e.msg}; fix the config file")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8")
    except SystemExit as e:  # sys.exit(0) in a config ended train.py with exit 0, nothing trained and nothing said
        raise ConfigError(f"{path}: calls sys.exit({e.code!r}); a config file only sets keys")
    except Exception as e:
        raise ConfigError(f"{path}: raised {type(e).__name__}: {e}; fix the config file")


class AssignedNames(dict):
    """A config file's globals that note each name its top-level code assigns: `top_k = 2` over a default of 2 is
    the same object (small ints, True, short strings), which an identity test took for untouched."""
    def __init__(self, *args):
        super().__init__(*args)
        self.assigned = set()

    def __setitem__(self, key, value):
        self.assigned.add(key)
        super().__setitem__(key, value)


def exec_config_file(path, g):
    if os.path.isdir(path):
        raise ConfigError(f"{path} is a directory; pass a config file (config/tiny.py) or --key=value overrides")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} not found; pass a file under config/ or --key=value overrides")
    before = config_keys(g)
    defaults = {k: copy.deepcopy(g[k]) for k in before}  # lr_mult["old"] = x must not edit the script's own default
    scope = AssignedNames({**g, **defaults})
    exec_file(path, scope)
    for k in config_keys(scope) - before:
        if k not in g and k != "__builtins__":
            raise ConfigError(f"{path}: unknown config key '{k}'{closest(k, before)} (a name only the file uses "
                              f"itself: call it _{k})")
    set_keys = []
    for k in sorted(before):  # assigned (even to the default's value) or changed in place: both checked, both given
        if k not in scope:  # (a KeyError traceback)
            raise ConfigError(f"{path}: deletes config key '{k}' (del); a config file sets keys, it cannot remove one")
        if k in scope.assigned or scope[k] is not defaults[k] or scope[k] != g[k]:
            try:
                g[k] = coerce(k, scope[k], g[k])
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}")
            set_keys.append(k)
    return set_keys


DATA_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
            ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_INT_BITS, MAX_ITEMS = 4096, 100_000  # what a plain config needs, far below what takes long to compute
# a whole value's size (items, characters, 64-bit words of ints; a part held twice counted twice, as repr and
# json.dump walk it) and nesting: [[x] * 10**5] * 10**5 has small containers only, and 10**10 items to print
MAX_WEIGHT, MAX_DEPTH = 1_000_000, 32


def not_data(text):
    """None if a config file's text is plain data, else (line, what): a file from another machine (relay's
    config.py) is exec'd by train.py, so it may hold no code. Plain data: assignments to names (not to dict) of
    literals, names assigned above, arithmetic and dict(key=value); evaluated here on bounded values (ints of
    at most 4096 bits, strings and containers of at most 100,000 items, a whole value of at most 1,000,000 items
    nested at most 32 deep), so nothing in it takes long to compute, print or save."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        return e.lineno or 0, f"syntax error: {e.msg}"
    except (RecursionError, MemoryError):  # nested past the parser's depth (x = 1+1+...): refused, not a traceback
        return 0, "nested too deeply to parse"
    known = {}  # name -> value, of the assignments above

    def shown(node):  # ast.unparse recurses as deep as the tree: a RecursionError from ~500 levels, so the text as written
        try:
            return ast.unparse(node).splitlines()[0][:60]
        except (RecursionError, ValueError):  # (ValueError: an int literal past 4300 digits, 0xfff...: a traceback)
            return (ast.get_source_segment(text, node) or "").split("\n")[0][:60]

    class Refused(Exception):
        pass

    weighed = {}  # id(container) -> (container, weight, depth); the container kept, so its id is not reused

    def weight(v):  # (its size as repr walks it, its depth); a container's items were weighed when built
        if id(v) in weighed:
            return weighed[id(v)][1:]
        if isinstance(v, (str, bytes)):
            return 1 + len(v), 0
        if isinstance(v, int) and not isinstance(v, bool):
            return 1 + v.bit_length() // 64, 0
        if not isinstance(v, (list, tuple, set, dict)):
            return 1, 0
        parts = [weight(x) for x in (list(v) + list(v.values()) if isinstance(v, dict) else v)]
        w, d = 1 + sum(p[0] for p in parts), 1 + max((p[1] for p in parts), default=0)
        if w > MAX_WEIGHT or d > MAX_DEPTH:
            raise Refused
        weighed[id(v)] = (v, w, d)
        return w, d

    def small(v):
        if v is None or isinstance(v, (bool, float, complex)):
            return v
        if isinstance(v, int) and v.bit_length() <= MAX_INT_BITS:
            return v
        if isinstance(v, (str, bytes, list, tuple, set, dict)) and len(v) <= MAX_ITEMS:
            weight(v)
            return v
        raise Refused

    def value(node):
        if isinstance(node, ast.Constant):
            return small(node.value)
        if isinstance(node, ast.Name):  # only names this file assigned above (not a builtin, not the script's)
            if node.id not in known:
                raise Refused
            return known[node.id]
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = [value(e) for e in node.elts]
            return small({ast.List: list, ast.Tuple: tuple, ast.Set: lambda x: set(map(repr, x))}[type(node)](items))
        if isinstance(node, ast.Dict) and None not in node.keys:
            return small({repr(value(k)): value(v) for k, v in zip(node.keys, node.values)})
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = value(node.operand)
            if not isinstance(v, (int, float, complex)):
                raise Refused
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in DATA_OPS:
            a, b = value(node.left), value(node.right)
            number = (int, float, complex)
            if isinstance(node.op, ast.Pow):  # 9**9**9 would hang: an exponent of at most 64, a base of few bits
                if not (isinstance(a, number) and isinstance(b, number) and not isinstance(b, complex) and abs(b) <= 64
                        and (not isinstance(a, int) or a.bit_length() * abs(b) <= MAX_INT_BITS)):
                    raise Refused
            elif isinstance(node.op, ast.Mult):  # "x" * 10**12 would fill memory
                if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
                    raise Refused
                for seq, n in ((a, b), (b, a)):
                    if isinstance(seq, (str, bytes, list, tuple)) and (not isinstance(n, int) or len(seq) * n > MAX_ITEMS):
                        raise Refused
            elif not isinstance(node.op, ast.Add) and not (isinstance(a, number) and isinstance(b, number)):
                raise Refused  # "%0999999999d" % 1 is a gigabyte
            try:
                return small(DATA_OPS[type(node.op)](a, b))
            except (ArithmeticError, TypeError, ValueError):
                raise Refused
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return small({k.arg: value(k.value) for k in node.keywords})
        raise Refused

    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if (isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)
                and not any(t.id == "dict" for t in stmt.targets)):  # dict = open: dict(...) would then call it
            try:
                v = value(stmt.value)
            except (Refused, RecursionError):
                return stmt.lineno, shown(stmt.value)
            known.update((t.id, v) for t in stmt.targets)
            continue
        return stmt.lineno, shown(stmt)
    return None


def configure(g, argv):
    """Apply config files and --key=value overrides from argv to the globals dict g; returns what set which key,
    in order: (key, config file path), or (key, None) for a --key=value override."""
    keys = config_keys(g)
    changed, overridden = [], {}  # overridden: key -> the --key=value given for it so far
    for arg in argv:
        if not arg.startswith("--"):
            set_keys = exec_config_file(arg, g)
            lost = [k for k in set_keys if k in overridden]
            if lost:  # (applied in order, the file's value replaced the user's override without a word)
                raise ConfigError(f"{overridden[lost[0]]} is given before {arg}, which sets {lost[0]} too and would "
                                  f"replace it; put {overridden[lost[0]]} after {arg}")
            changed += [(k, arg) for k in set_keys]
            continue
        if "=" not in arg:
            raise ConfigError(f"{arg}: overrides are written --key=value")
        key, text = arg[2:].split("=", 1)
        if key not in keys:
            raise ConfigError(f"unknown config key {key!r}"
                              f"{closest(key, keys) or f'; drop --{key} (the keys are the globals atop the script)'}")
        value = coerce(key, parse_value(key, text, g[key]), g[key])
        # a dict updates the one there: --lr_mult="{'new': 2.0}" over a config's {'old': 0.1, ...} dropped 'old'
        g[key] = {**g[key], **value} if isinstance(g[key], dict) and isinstance(value, dict) else value
        overridden[key] = arg
        changed.append((key, None))
    return changed


def configure_or_exit(g, argv, prog=None):
    try:
        return configure(g, argv)
    except ConfigError as e:
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        sys.exit(2)


def help_text(g, doc, prog, applied=()):
    """The script's docstring and its config keys with their values: the defaults, or with `applied` (config
    files and overrides given beside --help) applied to them."""
    title = f"config keys (with {' '.join(applied)} applied):" if applied else "config keys (defaults):"
    lines = [doc.strip(), "", f"usage: python {prog} [config/FILE.py ...] [--key=value ...]", "", title]
    for k in sorted(config_keys(g)):
        lines.append(f"  --{k}={g[k]!r}")
    return "\n".join(lines)
