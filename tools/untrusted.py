"""
One line for a file that a safe load refused. Every loader in the project reads pickles
with `torch.load(..., weights_only=True)` or an allow-list unpickler (tools/convert.py's
`_StudyUnpickler`), so a file holding code (a `__reduce__` that calls os.system, exec, ...)
or classes a checkpoint never has is refused before anything in it runs. Their errors are
long and suggest `weights_only=False`; `describe_load_error` turns them into one line that
names the refused global:

    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        raise ValueError(describe_load_error(e, path) or f"{path} cannot be read (truncated?)") from None

The globals are found by reading the pickle's opcodes (pickletools.genops): nothing is
imported or called.
"""

import pickle
import pickletools
import re
import warnings
import zipfile

# torch warns about pickle protocols above 2 (plain pickle.dump files) before refusing them:
# two lines of noise in front of the one-line refusal
warnings.filterwarnings('ignore', message='Detected pickle protocol', category=UserWarning)


class RefusedGlobal(pickle.UnpicklingError):
    """An allow-list unpickler met a global outside its list; `name` is 'module.name'."""

    def __init__(self, name):
        super().__init__(f"unsupported global {name}")
        self.name = name


# what torch.save writes for tensors and state dicts: never the global a refusal names
_CHECKPOINT_MODULES = ('torch', 'collections')
_STRING_OPS = ('SHORT_BINUNICODE', 'BINUNICODE', 'BINUNICODE8', 'UNICODE', 'STRING', 'BINSTRING',
               'SHORT_BINSTRING')


def _globals_in_stream(f, found, max_pickles=8):
    """Appends to `found` the 'module.name' of every GLOBAL / INST / STACK_GLOBAL in the
    pickles read from the binary file `f` (torch's legacy format holds several in a row);
    returns whether the first one is a whole pickle (parsed up to its STOP). STACK_GLOBAL
    takes its two names from the stack; they are pushed by string opcodes or fetched from
    the memo, which is followed for strings only."""
    whole = False
    for i in range(max_pickles):
        memo, pushed, last = {}, [], None
        try:
            for op, arg, _ in pickletools.genops(f):
                value = None
                if op.name in ('GLOBAL', 'INST'):
                    found.append(arg.replace(' ', '.'))
                elif op.name == 'STACK_GLOBAL' and len(pushed) >= 2 and None not in pushed[-2:]:
                    found.append(f"{pushed[-2]}.{pushed[-1]}")
                elif op.name in _STRING_OPS:
                    value = arg if isinstance(arg, str) else None
                elif op.name in ('GET', 'BINGET', 'LONG_BINGET'):
                    value = memo.get(arg)
                elif op.name == 'MEMOIZE':
                    memo[len(memo)] = last
                elif op.name in ('PUT', 'BINPUT', 'LONG_BINPUT'):
                    memo[arg] = last
                if op.name not in ('MEMOIZE', 'PUT', 'BINPUT', 'LONG_BINPUT', 'FRAME'):
                    pushed.append(value)
                    last = value
                    del pushed[:-2]
        except Exception:  # the end of the file, or bytes that are no pickle: what was found so far
            return whole
        whole = whole or i == 0
    return whole


def _scan(path):
    """(globals of `path`'s pickles, whether its first pickle is whole): a torch.save zip file
    (its *.pkl members), torch's legacy format or a plain pickle. Reads opcodes only."""
    found, whole = [], False
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                for member in z.namelist():
                    if member.endswith('.pkl'):
                        with z.open(member) as f:
                            whole = _globals_in_stream(f, found) or whole
        else:
            with open(path, 'rb') as f:
                whole = _globals_in_stream(f, found)
    except (OSError, zipfile.BadZipFile):
        pass
    return found, whole


def pickle_globals(path):
    """The globals ('module.name', in file order) the pickles of `path` name."""
    return _scan(path)[0]


def refused_global(exc):
    """The global an unpickler refused in `exc` (or an exception it caused or was wrapped in),
    '' when it refused the file without naming one, None when `exc` is no refusal."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RefusedGlobal):
            return e.name
        text = str(e)
        if isinstance(e, pickle.UnpicklingError) and 'Weights only load failed' in text:
            m = re.search(r"GLOBAL (\S+)", text)
            return m.group(1) if m else ''
        stack += [e.__cause__, e.__context__]
        # torch.distributed.checkpoint wraps a failure of its reader as {rank: (exception, traceback)}
        for failure in (getattr(e, 'failures', None) or {}).values():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def describe_load_error(exc, path):
    """One line for `exc`, raised while loading `path`, when it is a refusal of code or
    unknown classes (torch.load weights_only=True, RefusedGlobal); None otherwise (a
    truncated or damaged file: the caller says that)."""
    name = refused_global(exc)
    if name is None:
        return None
    if '.' not in name or name.split('.')[0] in _CHECKPOINT_MODULES:  # torch names builtins without their module
        found, whole = _scan(path)
        others = [g for g in found if g.split('.')[0] not in _CHECKPOINT_MODULES]
        if not name and not others and not whole:
            return None  # bytes that are no pickle (torch reports those as refusals too): damaged
        same = [g for g in others if name and g.endswith('.' + name)]
        name = (same or others or [name])[0]
    what = f"holds code or unknown classes ({name})" if name else \
        "holds pickle opcodes that a weights-only load refuses (a plain pickle, not a torch.save file)"
    return f"{path} {what}: refused, nothing in it was run; get the file again from a source you trust"
