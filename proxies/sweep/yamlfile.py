"""Reading a sweep file into plain data, refusing what would mislead or exhaust the loader.

A sweep file is trusted like a shell script (it names the commands to run), but a mistake
in it must end in one line, never in a traceback, a hang or a silent surprise:

- only a regular file of at most MAX_FILE_BYTES is read (a FIFO or /dev/zero is refused
  before it is read, so the sweep cannot block on it); PyYAML reads about 100 KB a second
  here, so the bound is also one on time;
- brackets ([ and {) may nest at most MAX_BRACKETS deep, counted before parsing: PyYAML's
  scanner is quadratic in that depth (1,200 levels take 2 s, a file of them hours) and its
  composer recursive (libyaml's crashes the process);
- the bytes must be UTF-8: the error names the byte offset of the first bad byte;
- a key given twice in one mapping is an error naming both lines (YAML keeps the last one
  silently, so `ranks:` written twice would sweep only the second list);
- the document, aliases counted at each use (a "billion laughs" file is small but huge
  once expanded), has at most MAX_VALUES values nested at most MAX_NESTING deep;
- no string, key or value, holds a NUL character: none can be passed to a process.
"""

from __future__ import annotations

import os
import re
import stat

import yaml

MAX_FILE_BYTES = 256 << 10
MAX_BRACKETS = 100
MAX_VALUES = 100_000
MAX_NESTING = 32
MERGE_TAG = "tag:yaml.org,2002:merge"
BRACKETS = re.compile(r"[\[\]{}]")


class LoadError(ValueError):
    """The file cannot be read as a sweep: the message is one line, the path first."""


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, line: int, first: int):
        super().__init__(
            f"line {line}: {key!r} is given twice in one mapping (first on line {first})"
        )


class StrictLoader(yaml.SafeLoader):
    """SafeLoader refusing a key given twice in one mapping. Keys brought in by a merge
    (`<<: *defaults`) may be overridden, as YAML intends; only explicit keys are compared."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[object, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # unhashable: the base class says so
                    continue
        return super().construct_mapping(node, deep)


def read(path: str) -> object:
    """The YAML document in `path` as plain data; LoadError with one line otherwise."""
    text = read_text(path)
    check_brackets(text, path)
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader)
    except DuplicateKey as e:
        raise LoadError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise LoadError(f"{path}: {yaml_problem(e)}") from None
    except (RecursionError, MemoryError):
        raise LoadError(f"{path}: nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise LoadError(f"{path}: not a sweep file: {one_line(str(e))}") from None
    check_document(data, path)
    return data


def read_text(path: str) -> str:
    try:
        # O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise LoadError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError:  # a NUL in the path
        raise LoadError(f"{path!r}: cannot read: the path holds a NUL character") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoadError(f"{path}: cannot read: not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise LoadError(
                f"{path}: {st.st_size} bytes: a sweep file may have at most {MAX_FILE_BYTES}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise LoadError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # grew while we read
        raise LoadError(f"{path}: a sweep file may have at most {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise LoadError(
            f"{path}: byte offset {e.start} (line {line}): not UTF-8 text "
            f"(byte 0x{data[e.start]:02x})"
        ) from None
    return text.removeprefix("\ufeff")


def check_brackets(text: str, path: str) -> None:
    """Refuse flow collections nested deeper than MAX_BRACKETS. Quotes are not parsed: a
    bracket inside a string counts too, which errs only towards refusing a file with a
    hundred unclosed brackets in its strings."""
    depth = 0
    for m in BRACKETS.finditer(text):
        depth = depth + 1 if m.group() in "[{" else max(0, depth - 1)
        if depth > MAX_BRACKETS:
            line = text.count("\n", 0, m.start()) + 1
            raise LoadError(f"{path}: line {line}: brackets nested more than {MAX_BRACKETS} deep")


def yaml_problem(e: yaml.YAMLError) -> str:
    """One line: where (line) and what, from any of PyYAML's errors."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark else ""
    if isinstance(e, yaml.reader.ReaderError):
        return f"character {e.position}: not valid YAML: {e.reason}"
    problem = getattr(e, "problem", None) or str(e)
    return f"{where}not valid YAML: {one_line(problem)}"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def check_document(data: object, path: str) -> None:
    """Bound the document's size (aliases counted at each use) and nesting, and refuse NUL
    characters, without recursion: a key path names where."""
    count = 0
    stack: list[tuple[object, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise LoadError(
                f"{path}: more than {MAX_VALUES} values (aliases counted at each use): "
                "too large for a sweep file"
            )
        if depth > MAX_NESTING:
            raise LoadError(f"{path}: {where}: nested more than {MAX_NESTING} deep")
        if isinstance(value, str) and "\0" in value:
            raise LoadError(f"{path}: {where or 'a value'}: holds a NUL character")
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and "\0" in k:
                    raise LoadError(f"{path}: {where or 'a key'}: a key holds a NUL character")
                stack.append((v, f"{where}.{k}" if where else str(k), depth + 1))
        elif isinstance(value, (list, tuple, set)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
