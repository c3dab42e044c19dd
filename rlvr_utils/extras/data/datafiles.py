"""Local data files read the way TRL's users read them, through `datasets.load_dataset`, so that a reward receives the
values (and types) a GRPOTrainer would hand it from the same file; every row with the place it came from (`file:line`),
for the checks before a run and for the tasks (a reward's error names the row's line).

Each file is first checked here, so that a file that cannot be read is one error naming its line: .jsonl, .json (an
array of objects, or one object per line), either gzipped (.gz), with Python's own JSON reader (a line at a time, or
the whole array at once, with its own line and column on an error); NaN and Infinity, which JSON does not have, a key
twice in one object and JSON nested too deep for the reader are an error naming the line; a CSV header that names a
column twice. Then the rows' values come from `load_dataset` ("json", "csv", "parquet", "arrow"), the files of one kind
in one call (one schema for all, as `load_dataset(kind, data_files=[...])` gives a directory's files): a JSON column of
ints and floats reads as floats (7 -> 7.0), a column mixing numbers and strings as `datasets` decodes it ("007" -> 7),
a key missing from a row as None, and a file `datasets` cannot read (an int beyond 64 bits, say) is an error naming it,
as a TRL user's `load_dataset` raises; CSV cells typed by pandas per column. A directory: each of its data files in
name order. Suffixes are matched in any case (.JSONL).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
import os
import re
import zlib
from pathlib import Path

JSON_SUFFIXES = (".jsonl", ".json")
TABLE_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
READ = ".jsonl, .json (also .gz), .csv, .tsv, .parquet, .arrow, or a directory of them"


class DataFileError(ValueError):
    """A data file that cannot be read as rows; the message names the file (and the line)."""


class CacheError(DataFileError):
    """The datasets cache cannot be written (full, read-only, not a directory): the message names the cache, not the
    data file, which is fine."""


def suffix(path: Path) -> str:
    """The data suffix of a file, lower case, under a .gz (`rows.JSONL.gz` -> `.jsonl`); '' when it has none."""
    name = path.name.lower().removesuffix(".gz")
    return Path(name).suffix


def is_data_file(path: Path) -> bool:
    s = suffix(path)
    gz_ok = not path.name.lower().endswith(".gz") or s in JSON_SUFFIXES
    return path.is_file() and not path.name.startswith(".") and gz_ok and (s in JSON_SUFFIXES or s in TABLE_SUFFIXES)


def data_files(path: str | Path) -> list[Path]:
    """The files a --data-path names: itself, or a directory's data files in name order."""
    p = Path(os.path.expanduser(path))
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if is_data_file(f))
        if not files:
            raise DataFileError(f"{path}: the directory holds no data file ({READ})")
        held = [f.name for f in files if re.search(r"(^|[-_.])(test|validation|valid|eval|dev)([-_.]|$)", f.name)]
        if held and len(held) < len(files):  # train.jsonl + test.jsonl: one training set would leak the test rows
            raise DataFileError(
                f"{path}: the directory holds split files ({held[0]} beside {len(files) - len(held)} other): pass the "
                "training file with --data-path and the held-out one with --eval-data-path"
            )
        return files
    if p.exists() and not p.is_file():
        raise DataFileError(f"{path}: not a regular file (a FIFO or a device?): expected {READ}")
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if not is_data_file(p):
        raise DataFileError(f"{path}: expected {READ}")
    return [p]


def read_rows(path: str | Path) -> tuple[list[dict], list[str]]:
    """Every row of a data file or directory as `datasets.load_dataset` reads it, and where each came from
    (`file:line`, or `file: row N` for parquet and arrow). Raises DataFileError (or FileNotFoundError) naming the file
    and the line."""
    files = data_files(path)
    lines = {f: _json_lines(f) if suffix(f) in JSON_SUFFIXES else _table_lines(f) for f in files}
    loaded, rows, wheres = _loaded(files, lines), [], []
    for f in files:
        got, where = loaded[f], lines[f]
        if not got:
            raise DataFileError(f"{f}: the file holds no rows")
        rows += got
        wheres += where if where and len(where) == len(got) else [f"{f}: row {i}" for i in range(1, len(got) + 1)]
    return rows, wheres


def _kind(f: Path) -> tuple[str, dict]:
    """The `load_dataset` builder of a file and its keywords."""
    s = suffix(f)
    return ("json", {}) if s in JSON_SUFFIXES else (TABLE_SUFFIXES[s], {"sep": "\t"} if s == ".tsv" else {})


def _loaded(files: list[Path], lines: dict) -> dict:
    """Each file's rows from `load_dataset`: the files of one kind together (one schema, as a TRL user's one call over
    them gives), split back by each file's rows; files whose rows cannot be counted first, or that `datasets` cannot
    read together (two schemas), one at a time."""
    groups: dict = {}
    for f in files:
        groups.setdefault(repr(_kind(f)), []).append(f)
    out = {}
    for group in groups.values():
        counts = [len(lines[f]) if lines[f] is not None else -1 for f in group]
        rows = _load(group) if len(group) > 1 and min(counts) >= 0 else None
        if rows is not None and len(rows) == sum(counts):
            it = iter(rows)
            out |= {f: [next(it) for _ in range(n)] for f, n in zip(group, counts)}
        else:
            out |= {f: _load([f], alone=True) for f in group}
    return out


def _load(files: list[Path], alone: bool = False) -> list[dict] | None:
    """`load_dataset(kind, data_files=files, split="train")`'s rows; a file it cannot read: DataFileError naming it
    (`alone`), several files: None."""
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # a local file loads in a moment: no "Generating train split" bars
    kind, extra = _kind(files[0])
    try:
        return list(load_dataset(kind, data_files=[str(f) for f in files], split="train", **extra))
    except Exception as e:  # not a parquet file, a ragged CSV, a JSON column datasets cannot type, ...
        if (cache := _cache_problem(e)) is not None:
            raise CacheError(cache) from None
        if not alone:
            return None
        first = str(e).splitlines()[0] if str(e) else ""
        why = f"{type(e).__name__}: {first[:150]}"
        raise DataFileError(f"{files[0]}: cannot be read as {suffix(files[0])[1:]} by datasets ({why})") from None


def _cache_problem(e: Exception) -> str | None:
    """`load_dataset` writes each file it reads as Arrow into the datasets cache: a failure there (a full disk, a
    read-only or missing directory) in one line naming the cache and how to move it, or None for any other error."""
    from datasets import config

    cache = Path(config.HF_DATASETS_CACHE)
    name = os.fsdecode(getattr(e, "filename", None) or "")
    full = re.search(r"No space left on device|Disk quota exceeded|Read-only file system", str(e))
    if not (name and Path(name).is_relative_to(cache)) and not full:
        return None
    why = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
    return (
        f"the datasets cache {cache} cannot be written ({why}): datasets writes each data file it reads there as "
        "Arrow; free space there or make it writable, or set HF_DATASETS_CACHE to a directory that is"
    )


def row_name(where: str, i: int) -> str:
    """`rows.jsonl: row 3 (line 4)` from a row's place `rows.jsonl:4` and its 1-based number in the data."""
    file, _, line = where.rpartition(":")
    return f"{file}: row {i} (line {line})" if line.isdigit() else f"{where.split(': row ')[0]}: row {i}"


_BETWEEN = re.compile(r"[ \t\n\r,]*")  # JSON's whitespace (not str.isspace's, which U+2028 would pass), commas


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value (write null, or a number)")


def _unique_keys(pairs: list) -> dict:
    row = dict(pairs)
    if len(row) < len(pairs):  # JSON readers keep one of the two values, silently
        keys = [k for k, _ in pairs]
        raise ValueError(f"the key {next(k for k in keys if keys.count(k) > 1)!r} appears twice in one object")
    return row


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: Python reads it as inf
        raise ValueError(f"{text} is too large for a float (write null, or a smaller number)")
    return value


# the json module's hooks that refuse what JSON does not hold: NaN / Infinity, a float too large, a key twice
_STRICT = dict(parse_constant=_refuse_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)


def sha256_file(path: Path, h=None):
    """sha256 of a file's bytes (`h`: a hash to go on feeding), read 16 MB at a time: a multi-GB model shard or data
    file is not read into memory whole (resume.py compares LoRA bases, data_tasks.py hashes data files)."""
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h


def _text(f: Path) -> str:
    try:
        gz = f.name.lower().endswith(".gz")  # utf-8-sig: a byte-order mark at the start (Windows tools) is dropped
        with gzip.open(f, "rt", encoding="utf-8-sig") if gz else f.open(encoding="utf-8-sig") as h:
            return h.read()
    except EOFError:
        raise DataFileError(f"{f}: the compressed file is cut short (an interrupted download or copy?)") from None
    except zlib.error as e:  # damaged compressed data (gzip's own checks raise OSError)
        raise DataFileError(f"{f}: the compressed data is damaged (zlib: {e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"{f}: cannot be read ({type(e).__name__}: {e})") from None


def _loads(text: str, f: Path, lineno: int):
    try:
        return json.loads(text, **_STRICT)
    except json.JSONDecodeError as e:
        raise DataFileError(f"{f}:{lineno + e.lineno - 1}: not a JSON object ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # NaN / Infinity, a key twice, nested thousands deep
        raise DataFileError(f"{f}:{lineno}: {_why(e)}") from None


def _why(e: Exception) -> str:
    return "JSON nested too deep to read (thousands of levels)" if isinstance(e, RecursionError) else str(e)


def _json_lines(f: Path) -> list[str]:
    """A JSON file checked row by row as Python's reader reads it: the place (`file:line`) of each row."""
    text = _text(f)
    if not text.strip():
        raise DataFileError(f"{f}: the file is empty (expected one JSON object per line)")
    if suffix(f) == ".json" and text.lstrip().startswith("["):  # an array of rows, read whole
        try:
            rows = _loads(text, f, 1)
        except DataFileError:  # a NaN, a key twice, too deep: said again at the line of the row that holds it
            _array_lines(text, len(text), f)
            raise
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        lines = _array_lines(text, len(rows))
        if bad is not None:
            raise DataFileError(f"{f}:{lines[bad]}: the JSON array must hold one object per row")
        if not rows:
            raise DataFileError(f"{f}: the JSON array holds no rows")
        return [f"{f}:{line}" for line in lines]
    wheres = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit inside a JSON string
        if not line.strip():
            continue
        row = _loads(line, f, lineno)
        if not isinstance(row, dict):
            raise DataFileError(f"{f}:{lineno}: expected a JSON object, got {type(row).__name__}")
        wheres.append(f"{f}:{lineno}")
    return wheres


def _array_lines(text: str, n: int, f: Path | None = None) -> list[int]:
    """The line each of the first `n` elements of a JSON array starts on: one pass of the decoder. `f`: an element
    that cannot be read (the checks of `_loads`) is a DataFileError naming its line; the array's end stops the pass."""
    decoder, i, lines, at, line = json.JSONDecoder(**(_STRICT if f else {})), text.index("[") + 1, [], 0, 1
    for _ in range(n):
        start = _BETWEEN.match(text, i).end()
        line, at = line + text.count("\n", at, start), start
        if text.startswith("]", start) or f and text.count(",", i, start) != (1 if lines else 0):
            break  # the array's end, or a comma missing or one too many: the whole array's message says where
        lines.append(line)
        try:
            i = decoder.raw_decode(text, start)[1]
        except (ValueError, RecursionError) as e:
            if f is None:
                raise
            if not isinstance(e, json.JSONDecodeError):  # a syntax error: the whole array's message has its line
                raise DataFileError(f"{f}:{line}: {_why(e)}") from None
            break
    return lines


def _table_lines(f: Path) -> list[str] | None:
    """A table checked before `datasets` reads it: each CSV/TSV record's first line (`file:line`, the header's left
    out), a parquet file's `file: row N`; None where the rows are not counted here (arrow)."""
    s = suffix(f)
    if TABLE_SUFFIXES[s] == "csv":
        starts = _record_lines(f, "\t" if s == ".tsv" else ",")
        if len(starts) < 2:  # the header (or nothing)
            raise DataFileError(f"{f}: the file holds no rows (expected a header line, then one row per line)")
        return [f"{f}:{n}" for n in starts[1:]]
    n = _parquet_rows(f) if s == ".parquet" else None
    if n == 0:
        raise DataFileError(f"{f}: the file holds no rows")
    return None if n is None else [f"{f}: row {i}" for i in range(1, n + 1)]


def _record_lines(f: Path, sep: str) -> list[int]:
    """The first line of each record of a CSV/TSV file (a quoted cell may span lines; blank lines are skipped)."""
    try:
        with f.open(newline="", encoding="utf-8") as h:
            reader, starts, previous = csv.reader(h, delimiter=sep), [], 0
            for record in reader:
                if record and not starts and len(set(record)) < len(record):  # the header: pandas would rename one
                    twice = next(c for c in record if record.count(c) > 1)
                    raise DataFileError(f"{f}:{reader.line_num}: the column {twice!r} appears twice in the header")
                if record:
                    starts.append(previous + 1)
                previous = reader.line_num
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataFileError(f"{f}: cannot be read ({type(e).__name__}: {e})") from None
    return starts


def _parquet_rows(f: Path) -> int | None:
    """A parquet file's row count from its footer (None when it cannot be read: `load_dataset` then says why)."""
    try:
        import pyarrow.parquet as pq

        return pq.ParquetFile(f).metadata.num_rows
    except Exception:
        return None
