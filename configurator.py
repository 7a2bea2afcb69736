"""
nanoGPT-style configuration: config files executed over train.py's globals, then
--key=value overrides. Used from train.py as

    from configurator import configure, comments_from_source
    config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))]
    configure(globals(), config_keys, sys.argv[1:], help_text=comments_from_source(__file__))

so that e.g.

    python train.py config/attnres_L32.py --batch_size=8 --device=cpu

first runs config/attnres_L32.py, then applies the two overrides (command-line
overrides always win over config files, whatever their order). Unlike nanoGPT's
configurator, a misspelt key or a value of the wrong type is an error, not a
silently ignored or silently retyped setting, and a float setting must be a finite number
(nan and inf are refused: they would reach the optimizer or a loop bound);
`python train.py --help` lists every key. `finite_float` is the same check as an
argparse type (cost.py).
"""

import argparse
import ast
import difflib
import io
import math
import os
import signal
import sys
import tokenize
import types


def stop_while_starting():
    """A script's first call, before its heavy imports (train.py, study/sweep.py): Ctrl-C or
    SIGTERM while the libraries load and the settings are read, before anything is written, is
    one line and exit status 130 / 143, not a traceback or silence. The script's own handler
    (checkpoint.catch_signals, the sweep's) replaces it once it has something to say."""
    def stop(signum, frame):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        if int(os.environ.get('RANK', 0)) == 0:  # under torchrun, rank 0 speaks
            what = 'interrupted' if signum == signal.SIGINT else 'terminated (SIGTERM)'
            sys.stdout.write(f"{what} while starting: nothing was written; run the same command again\n")
            sys.stdout.flush()
        os._exit(128 + signum)  # nothing to undo yet, and no half-done import can catch it
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


class ConfigError(ValueError):
    """A bad config file or command-line override (the message names the fix)."""


def _close(key, keys):
    matches = difflib.get_close_matches(key, keys, n=3)
    return f" (did you mean {', '.join(matches)}?)" if matches else ""


def finite_float(text):
    """argparse type: `text` as a float that is a finite number. Raises argparse.ArgumentTypeError
    (argparse's one-line usage error) for anything else, nan and inf included."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _check_type(key, value, current, where, declared=None):
    """Return `value` converted to the type of `current`, or raise ConfigError; a float value
    (of any key) must be finite. `declared`: the type of a key whose default is None (None
    itself stays allowed), or a tuple of the types a key accepts; without it a None default
    accepts anything."""
    try:
        value = _convert(key, value, current, where, declared)
    except OverflowError:  # an int too large for a float key: --learning_rate=1000...0
        value = math.inf
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {key} = {value!r} is not a finite number; give a finite value")
    return value


def _convert(key, value, current, where, declared=None):
    """_check_type's conversion, without the finiteness check."""
    default = current
    if isinstance(declared, tuple):  # one of several types, e.g. (str, bool) for fast = 'auto' | True | False
        if bool in declared and isinstance(value, str) and value.lower() in ('true', 'false'):
            return value.lower() == 'true'
        if isinstance(value, declared):
            return value
        raise ConfigError(f"{where}: {key} expects {' or '.join(t.__name__ for t in declared)} "
                          f"(default {default!r}), got {value!r} ({type(value).__name__})")
    if declared is not None:
        if value is None:
            return value
        current = declared()  # a stand-in of the declared type: False, 0, 0.0 or ''
    if current is None:
        return value
    if isinstance(current, bool):  # checked before int: bool is a subclass of int
        if isinstance(value, str) and value.lower() in ('true', 'false'):
            return value.lower() == 'true'
        if isinstance(value, bool):
            return value
    elif isinstance(current, float) and type(value) is int:
        return float(value)  # --learning_rate=1 means 1.0
    elif type(value) is type(current):
        return value
    raise ConfigError(f"{where}: {key} expects {type(current).__name__} (default {default!r}), "
                      f"got {value!r} ({type(value).__name__})")


def _assigned_names(tree):
    """Names a module assigns at its top level (`x = ...`, `x: int = ...`, `x += ...`, `a, b = ...`)."""
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _run_config_file(path, g, keys, none_types):
    """Execute a config file; return {key: value} for the declared keys it changed or
    assigns (also to the value they already have: a resumed run checks those against its
    checkpoint, train.py)."""
    if not os.path.isfile(path):
        hint = f"; to override a key write --{path}" if '=' in path else ""
        raise ConfigError(f"config file not found: {path}{hint}")
    with open(path, 'rb') as f:
        data = f.read()
    try:
        source = data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): a config file is Python source; save it "
                          f"as UTF-8") from None
    ns = {k: g[k] for k in keys}  # the file sees (and may build on) the current values
    before = dict(ns)
    try:
        tree = ast.parse(source, path)
        assigned = _assigned_names(tree)
        exec(compile(tree, path, 'exec'), ns)
    except Exception as e:
        raise ConfigError(f"{path} failed: {type(e).__name__}: {e}") from e
    changed = {}
    for name, value in ns.items():
        if name.startswith('_') or isinstance(value, types.ModuleType) or callable(value):
            continue  # private helpers, imports, functions and classes are allowed
        if name not in before:
            raise ConfigError(f"{path}: unknown config key {name!r}{_close(name, keys)}; "
                              f"prefix helper variables with _")
        if (type(value), value) != (type(before[name]), before[name]) or name in assigned:
            changed[name] = _check_type(name, value, g[name], path, none_types.get(name))
    return changed


def _parse_override(arg, g, keys, none_types):
    """Parse one '--key=value' argument into (key, value)."""
    key, raw = arg[2:].split('=', 1)
    if key not in keys:
        raise ConfigError(f"unknown config key {key!r} in {arg}{_close(key, keys)}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = raw  # a bare word such as --device=cpu
    if (isinstance(g[key], str) or none_types.get(key) is str) and not isinstance(value, str):
        value = raw  # a str key keeps the literal text: --run_name=2024 is '2024'
    if isinstance(value, str) and (isinstance(g[key], float) or none_types.get(key) is float):
        try:  # --learning_rate=nan / inf: refused below as not finite, not as a string
            number = float(value)
        except ValueError:
            number = 0.0
        if not math.isfinite(number):
            value = number
    return key, _check_type(key, value, g[key], arg, none_types.get(key))


def print_help(g, keys, help_text=None):
    """Print every config key with its current (default) value and comment."""
    help_text = help_text or {}
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    print(f"usage: python {script} [config_file.py ...] [--key=value ...]\n\nconfig keys (default):")
    width = max((len(f"{k} = {g[k]!r}") for k in keys), default=0)
    for k in keys:
        line = f"{k} = {g[k]!r}"
        comment = help_text.get(k)
        print(f"  {line:<{width}}  # {comment}" if comment else f"  {line}")


def configure(g, keys, argv, help_text=None, none_types=None):
    """
    Apply config files and --key=value overrides to the dict `g` (train.py's globals()).

    g: the namespace to update; keys: the declared config keys (each must be in g);
    argv: sys.argv[1:]; help_text: key -> one-line description, shown by -h/--help;
    none_types: key -> type (int, float, bool or str) of a key whose default is None, or a
    tuple of the types a key accepts (fast: (str, bool)).
    Positional arguments are config files, executed in order; then every --key=value
    is parsed with ast.literal_eval (falling back to the raw string). Values must have
    the type of the key's current value (int accepted for float, 'true'/'false' for
    bool; for a None default, its type in `none_types`, or else anything). Returns the
    keys set, in order of first change.
    Raises ConfigError (a ValueError) on unknown keys, wrong types, missing files,
    '--key value'; raises SystemExit(0) after printing the help for -h/--help.
    """
    keys, none_types = list(keys), none_types or {}
    for k in keys:
        assert k in g, f"declared config key {k!r} is not in the namespace"
    if '-h' in argv or '--help' in argv:
        print_help(g, keys, help_text)
        raise SystemExit(0)
    files = [a for a in argv if not a.startswith('--')]
    overrides = [a for a in argv if a.startswith('--')]
    for arg in overrides:  # check the form first: in '--key value', 'value' is no config file
        if '=' not in arg:
            raise ConfigError(f"{arg}: write overrides as --key=value (one argument, no space)")
    changed = []
    for path in files:
        for key, value in _run_config_file(path, g, keys, none_types).items():
            g[key] = value
            changed.append(key)
    for arg in overrides:
        key, value = _parse_override(arg, g, keys, none_types)
        g[key] = value
        changed.append(key)
    changed = list(dict.fromkeys(changed))  # one entry per key, first-change order
    for key in changed:
        print(f"Overriding: {key} = {g[key]!r}")
    return changed


def comments_from_source(path):
    """
    Return {key: comment} for module-level `key = value  # comment` lines of a file,
    i.e. the trailing comment on the line where the assignment ends.
    """
    with open(path) as f:
        source = f.read()
    comments = {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip('#').strip()
    result = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if node.end_lineno in comments:
            for t in targets:
                if isinstance(t, ast.Name):
                    result[t.id] = comments[node.end_lineno]
    return result
