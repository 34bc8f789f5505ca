"""Small mutants of the reference: one copy of solutions/ with one mistake in it.

Each mutant is a text substitution; the original text must occur exactly once, so a mutant
cannot silently stop applying when the reference changes.
"""

import os
import re
import shutil

from course.exercises import STUDENT_FILES
from course.layout import SOLUTIONS


def make_mutant(dest, file, old, new):
    """Copy the reference into dest with `old` replaced by `new` in `file`; return dest."""
    os.makedirs(dest, exist_ok=True)
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(SOLUTIONS, name), dest)
    return plant(dest, file, old, new)


def plant(dest, file, old, new):
    """One more mistake in the copy at dest: `old` replaced by `new` in `file`; return dest."""
    path = os.path.join(dest, file)
    with open(path) as f:
        text = f.read()
    assert text.count(old) == 1, f"mutant text must occur once in solutions/{file}: {old!r}"
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    return str(dest)


def assert_caught(dest, mistake, file, old, new, check, hint):
    """Make the mutant, run the check on it, and show it fails with a message containing hint."""
    from course.launch import WorldFailed

    folder = make_mutant(dest, file, old, new)
    try:
        check(folder)
    except (AssertionError, WorldFailed) as caught:
        # A failed world shows as its sentence in the grade table and as its report in a script.
        said = str(caught) + ("\n" + caught.failure.sentence() if isinstance(caught, WorldFailed) else "")
        assert hint in said, f"the check caught '{mistake}' but its message does not say so: {said}"
        return
    raise AssertionError(f"the check passed a mutant with '{mistake}'")


def forbidden_or(name, hint):
    """What a check says of torch's own `name` (course/runtime/uprobes.py's ENTRIES) used where the exercise writes
    it by hand: the kernel's count, where it counts calls here; else hint, the check's own sentence."""
    from course.runtime import uprobes

    return f"used {uprobes.ENTRIES[name].called}" if uprobes.available((name,)) else hint


def assert_torch_own_caught(dest, mistake, file, old, new, check, name, monkeypatch):
    """The mutant uses torch's own `name`, which its exercise forbids: every check passes it but the count of its
    calls (the control: the check with its exercise forbidding nothing), which fails it, naming what it used: the
    kernel's count where it counts calls here, and the probe's process's where it counts none (a student's own
    grade)."""
    from checks import helpers
    from course.runtime import uprobes

    folder = make_mutant(dest, file, old, new)
    with monkeypatch.context() as patched:
        patched.setattr(helpers, "forbidden", lambda: ())
        check(folder)
    hint = f"used {uprobes.ENTRIES[name].called}"
    with monkeypatch.context() as patched:
        patched.setattr(uprobes, "available", lambda names=(): False)
        assert_caught(dest, mistake, file, old, new, check, hint)
    if uprobes.available((name,)):
        assert_caught(dest, mistake, file, old, new, check, hint)


def assert_refused(script, args, words):
    """`python solutions/SCRIPT ARGS` ends at once with one line on stderr that names what is wrong (argparse's
    exit status 2), not a traceback and not a world that runs."""
    from tests import warm

    done = warm.run([script, *args], cwd=SOLUTIONS, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{script}: error: "), (
        f"python {script} {' '.join(args)} ended with status {done.returncode} and said: {done.stderr}"
    )
    assert words in lines[0], f"python {script} {' '.join(args)} said: {lines[0]}"


# A stub as course/instructors/student.py writes it, on one line or on three.
_STUB = re.compile(r'^(\s*)raise NotImplementedError\((?:\n\s*)?"Exercise \d+: [^"]*"(?:\n\s*)?\)\n', re.M)


def does_nothing(dest):
    """The student files with every TODO answered by `pass` (a function that returns None, a loop
    that does nothing): code that does not do the exercise. Into dest; returns dest."""
    from course.layout import ROOT

    os.makedirs(dest, exist_ok=True)
    for name in STUDENT_FILES:
        with open(os.path.join(ROOT, name)) as f:
            text, stubs = _STUB.subn(r"\1pass\n", f.read())
        assert stubs and "NotImplementedError" not in text, (
            f"{name}: a stub that course/instructors/student.py did not write"
        )
        with open(os.path.join(dest, name), "w") as f:
            f.write(text)
    return str(dest)
