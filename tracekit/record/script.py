"""Recording an unmodified script: `tracekit record -- python train.py --lr 3e-4`.

The parent (`tracekit record`) runs the same interpreter command with a small
bootstrap instead of the script:

    python [interpreter options] -c BOOTSTRAP SETTINGS_JSON path|module|code TARGET ARGS...

The bootstrap starts a `Recorder` with global hooks, then runs the target the
way Python would (runpy with ``__main__``, ``sys.argv`` and ``sys.path[0]``
as usual), so the script's output, arguments and numerics are unchanged. On
exit, whether it returns, calls ``sys.exit`` or raises, the file is written
first and the exit then proceeds as it would have (same code, same traceback).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zipfile

BOOTSTRAP = "from tracekit.record.script import main; main()"
_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)*)?[dmu]*(\.exe)?$")
_OPTIONS_WITH_ARG = set("WX")


class NotPython(ValueError):
    """The command does not start a Python script, module or -c code that we can run."""


def is_python(exe) -> bool:
    if _PYTHON_NAME.match(os.path.basename(exe)):
        return True
    found = shutil.which(exe)
    return bool(found) and os.path.realpath(found) == os.path.realpath(sys.executable)


def parse_python_command(argv):
    """(python, interpreter options, mode, target, args) of `python [opts] script|-m mod|-c code args`."""
    if not argv or not is_python(argv[0]):
        raise NotPython(f"{argv[0] if argv else 'nothing'} is not a Python interpreter")
    exe, opts, i = argv[0], [], 1
    while i < len(argv):
        a = argv[i]
        if a == "--check-hash-based-pycs":
            opts += argv[i:i + 2]
            i += 2
            continue
        if a == "-" or not a.startswith("-") or a == "--":
            if a == "--":
                i += 1
            if i >= len(argv) or argv[i] == "-":
                raise NotPython("a script read from stdin or an interactive session cannot be recorded")
            return exe, opts, "path", argv[i], argv[i + 1:]
        # A cluster of one-letter options, e.g. -u, -OO, -uc CODE, -Wignore, -X dev.
        for j in range(1, len(a)):
            ch = a[j]
            if ch in "cm":
                rest = a[j + 1:]
                target = rest if rest else (argv[i + 1] if i + 1 < len(argv) else None)
                if target is None:
                    raise NotPython(f"option -{ch} needs an argument")
                if a[1:j]:
                    opts.append("-" + a[1:j])
                tail = argv[i + 1:] if rest else argv[i + 2:]
                return exe, opts, ("code" if ch == "c" else "module"), target, tail
            if ch in _OPTIONS_WITH_ARG:
                if j + 1 < len(a):
                    opts.append(a)
                    i += 1
                else:
                    opts += [a, argv[i + 1]] if i + 1 < len(argv) else [a]
                    i += 2
                break
        else:
            opts.append(a)
            i += 1
    raise NotPython("no script, -m module or -c code given to Python")


def child_command(argv, settings: dict):
    """The command that runs `argv` (a Python command) under the recorder."""
    exe, opts, mode, target, args = parse_python_command(argv)
    if mode == "path" and not os.path.exists(target):
        raise NotPython(f"cannot open the script {target!r}: no such file")
    return [exe, *opts, "-c", BOOTSTRAP, json.dumps(settings), mode, target, *args]


def child_env(env=None):
    """The environment for the child: tracekit importable even from another working directory."""
    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, root])
    return env


# -- the child side -------------------------------------------------------
def main():
    """The bootstrap: sys.argv is ['-c', SETTINGS_JSON, MODE, TARGET, *ARGS]."""
    settings = json.loads(sys.argv[1])
    mode, target, args = sys.argv[2], sys.argv[3], sys.argv[4:]
    try:  # the bootstrap's own line (`-c "...main()"`) is not part of the script's stacks
        from .stacks import hide

        hide(sys._getframe(1).f_code)
    except Exception:
        pass
    _hide_bootstrap_frames()
    recorder = _start_recorder(settings)
    try:
        _run(mode, target, args)
    except SystemExit as e:
        _note_exit(recorder, _exit_code(e.code), None)
        raise
    except KeyboardInterrupt:
        from .signals import same_interrupt

        with same_interrupt():
            if recorder is not None and recorder.signal is None:
                recorder.signal = "SIGINT"
            _note_exit(recorder, 130, "KeyboardInterrupt")
        raise
    except BaseException as e:
        _note_exit(recorder, 1, f"{type(e).__name__}: {e}")
        raise
    else:
        _note_exit(recorder, 0, None)


def _hide_bootstrap_frames():
    """Tracebacks of the script's errors start at the script, as they would without us."""
    import runpy

    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<string>", "<frozen runpy>"}
    original = sys.excepthook

    def excepthook(exc_type, exc, tb):
        while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        if exc is not None:
            exc.__traceback__ = tb  # the built-in hook prints exc.__traceback__
        original(exc_type, exc, tb)

    sys.excepthook = excepthook


def _start_recorder(settings):
    try:
        from .recorder import Recorder

        rec = Recorder(
            settings["output"], backend=settings.get("backend", "auto"), stacks=settings.get("stacks", "python"),
            max_entries=settings.get("max_entries"), activations=settings.get("activations", True),
            warmup=settings.get("warmup", 0), steps=settings.get("steps"), command=settings.get("command"),
            origins=settings.get("origins", True),
        )
        return rec.start()
    except Exception as e:  # never stop the script from running
        import warnings

        warnings.warn(f"tracekit: recording could not start ({e!r}); the script runs without it", RuntimeWarning)
        return None


def _note_exit(recorder, code, error):
    if recorder is None:
        return
    recorder.exit_code = code
    recorder.error = error
    try:
        recorder.close()
    except Exception as e:
        print(f"tracekit: could not write the recording ({e!r})", file=sys.stderr)
        return
    if recorder.written:
        print(f"tracekit: wrote {recorder.written}", file=sys.stderr)


def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message") prints the message and exits 1


def _run(mode, target, args):
    import runpy

    if mode == "path":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        if os.path.isfile(target) and not zipfile.is_zipfile(target):
            _run_file(target)
        else:  # a directory or zip file with __main__.py
            runpy.run_path(target, run_name="__main__")
    elif mode == "module":
        sys.argv = [target, *args]  # run_module replaces argv[0] with the module's file
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif mode == "code":
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main_module = sys.modules["__main__"]
        namespace = {"__name__": "__main__", "__builtins__": main_module.__builtins__, "__doc__": None}
        exec(compile(target, "<string>", "exec"), namespace)
    else:
        raise ValueError(f"unknown mode {mode!r}")


def _run_file(path):
    """Run a script file as __main__ the way `python path` does (absolute __file__, argv untouched)."""
    import builtins
    import io
    import types

    path = os.path.abspath(path)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins
    module.__cached__ = None
    sys.modules["__main__"] = module
    exec(code, module.__dict__)
