"""How the native matmul's calibration turns its times into a choice (`calibration.py` times
the products): which row counts the kernel takes, which of them its narrower build takes, and
which candidates were timed too close to noise to decide on one pass; or the choice as
`FLIPJAX_NATIVE_MATMUL_ROWS` sets it. This module imports nothing from flipjax."""

from __future__ import annotations

import functools

from kernels_pallas.matmul.calibration_file import DTYPES, MAX_ROWS, Times

ROWS_ENV = "FLIPJAX_NATIVE_MATMUL_ROWS"
TIE = 0.03  # the kernel at most this much slower than XLA's dot: a tie, as noise goes


def disputed(ratios: dict[int, float]) -> list[int]:
    """The candidate row counts whose verdict (the kernel's time over XLA's, `ratios`: won,
    lost, or tied within TIE) is the opposite of both its neighbours', which agree: one row
    count lost between two won (or won between two lost) is what a spell of a shared machine
    looks like, not what a product's rate does from one row count to the next. One calibration
    of an AVX2 build on a 2-core Zen 4 timed the lm head's kernel 12% slower than XLA's dot at
    4 rows, 36% faster at 2 and 12% at 8, and the run chosen left 4-8 rows to XLA's dot, which
    its decode steps then took 6 ms longer to multiply at 8 rows; timed again, 4 rows won."""
    rows = sorted(ratios)
    verdict = [(r < 1 - TIE) - (r > 1 + TIE) for r in (ratios[m] for m in rows)]
    return [
        rows[i]
        for i in range(1, len(rows) - 1)
        if verdict[i] != 0 and verdict[i - 1] == verdict[i + 1] == -verdict[i]
    ]


def choose_narrower(times: Times) -> dict[str, tuple[int, ...]]:
    """Per dtype, the row counts at which NARROWER's kernel was faster than the build's own by
    more than a tie (`TIE`): at a tie the build's own runs, so the choice follows only what the
    noise cannot explain."""
    return {
        name: tuple(m for m, t in sorted(by_rows.items()) if len(t) > 2 and t[2] * (1 + TIE) < t[0])
        for name, by_rows in times.items()
    }


def choose(times: Times) -> dict[str, range]:
    """Per dtype, the run of consecutive candidates over which the kernel saves the most (the
    sum of 1 - native/XLA time: a batch of each size counts alike), from its first row count to
    its last; none where it saves nothing. A run may bridge one candidate the kernel lost by
    less than its neighbours won, as noise on a busy machine does, and takes in the candidates
    at either end where the two tie (within `TIE`): one row is a matvec on either path, bound by
    reading the weight, so which wins there is noise (one calibration gave it to XLA by 1.3%,
    and its one-row decode steps then took 9% longer than the kernel's), and the kernel gives a
    row the same result whatever the rows beside it. The kernel's time at a row count that
    `choose_narrower` gives the narrower build is that build's."""
    choice = {}
    for name, by_rows in times.items():
        rows = sorted(by_rows)
        narrower = choose_narrower({name: by_rows})[name]
        ratio = [by_rows[m][2 if m in narrower else 0] / by_rows[m][1] for m in rows]
        best, first, last = 0.0, 0, -1
        total, start = 0.0, 0
        for i in range(len(rows)):
            if total <= 0:
                total, start = 0.0, i
            total += 1 - ratio[i]
            if total > best:
                best, first, last = total, start, i
        if last >= 0:
            while first > 0 and ratio[first - 1] <= 1 + TIE:
                first -= 1
            while last + 1 < len(rows) and ratio[last + 1] <= 1 + TIE:
                last += 1
        choice[name] = range(rows[first], rows[last] + 1) if last >= 0 else range(0)
    return choice


@functools.cache
def parse(spec: str) -> dict[str, range]:
    """`float32=2-32,bfloat16=1-8` (or `none`) as ranges; ValueError naming the variable."""
    if spec.strip() == "none":
        return {}
    choice = {}
    for part in spec.split(","):
        name, _, bounds = part.strip().partition("=")
        lo, _, hi = bounds.partition("-")
        if name not in DTYPES or name in choice or not (lo.isdigit() and hi.isdigit()):
            raise ValueError(
                f"{ROWS_ENV}: cannot read {part!r}; expected e.g. 'float32=2-32,bfloat16=1-8' "
                f"(dtypes {DTYPES}, each once) or 'none'"
            )
        if not 1 <= int(lo) <= int(hi) <= MAX_ROWS:
            raise ValueError(f"{ROWS_ENV}: {part!r} needs 1 <= low <= high <= {MAX_ROWS}")
        choice[name] = range(int(lo), int(hi) + 1)
    return choice
