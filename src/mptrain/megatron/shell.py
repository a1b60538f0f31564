"""The arguments a Megatron-LM launch script passes to ``pretrain_gpt.py``, read without running it.

Launch scripts build their command line from shell variables and arrays (Megatron-LM's
``examples/gpt3/train_gpt3_175b_distributed.sh``)::

    GPT_MODEL_ARGS=( --num-layers 96 --hidden-size 12288 )
    torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} --data-path $DATA_PATH

`read_script` interprets the subset of bash such scripts use, so no command of the script runs
(its ``mkdir``, ``exit``, ``export`` are not executed): assignments (``X=v``, ``export X=v``,
arrays ``X=( ... )`` over several lines, ``X+=( ... )``), expansions (``$X``, ``${X}``,
``${X[@]}``, ``${1:-default}``, ``$((A*B))``), quoting and word splitting as bash does them (an
array element ``"--split '99,1,0'"`` expanded unquoted gives the two words ``--split`` and
``'99,1,0'``, quotes kept), comments, line continuations, and ``if [[ ... ]]; then ... elif ...
else ... fi`` whose tests are ``==``, ``=``, ``!=``, ``-z``, ``-n``, ``-f``, ``-d``, ``-e``, ``!``,
``&&`` and ``||``. Command substitution ``$(...)`` is left as its text. The launch is the command
whose words include a ``.py`` script (``pretrain_gpt.py``): the words before it are the launcher's
(torchrun and its flags), those after it Megatron's arguments.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import os
import re
from typing import Iterator, Optional, Sequence

from mptrain.errors import ConfigError

NAME = r"[A-Za-z_][A-Za-z0-9_]*"
ASSIGN = re.compile(rf"^({NAME})(\+?)=")
OPERATORS = ("&&", "||", ";;", ";", "|", "&", "(", ")", "\n")


class ScriptError(ConfigError):
    """A construct of the script this reader does not interpret (one line: where, and the fix)."""


@dataclasses.dataclass
class Launch:
    """The launch command of a script: ``launcher`` (e.g. ``["torchrun", "--nproc_per_node", "8"]``),
    ``script`` (``pretrain_gpt.py``) and ``args`` (Megatron's arguments, as the program receives them)."""

    launcher: list
    script: str
    args: list
    arguments: tuple = ()
    """The script's own arguments it reads ($1, $2, ... up to the highest), each named by the variable the
    script assigns it to (``CHECKPOINT_PATH=$1``) or ``ARG<n>``: its usage line."""
    given: int = 0
    """How many of them were given."""


# A word is a list of parts (kind, text): kind "lit" (unquoted: expanded, then split on whitespace),
# "dq" (double-quoted: expanded, not split) or "sq" (single-quoted: taken as it is).
Word = list


def _lex(text: str) -> Iterator:
    """Words (lists of parts) and operator strings of the script text."""
    i, n = 0, len(text)
    word: list = []
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":  # line continuation
                i += 2
                continue
            word.append(("sq", text[i + 1]))
            i += 2
        elif c in " \t":
            if word:
                yield word
                word = []
            i += 1
        elif c == "#" and not word:
            while i < n and text[i] != "\n":
                i += 1
        elif c == "'":
            end = text.index("'", i + 1)
            word.append(("sq", text[i + 1:end]))
            i = end + 1
        elif c == '"':
            j = i + 1
            while text[j] != '"':
                j = _skip_dollar(text, j) if text[j] == "$" else j + (2 if text[j] == "\\" else 1)
            word.append(("dq", text[i + 1:j]))
            i = j + 1
        elif c == "$":
            j = _skip_dollar(text, i)
            word.append(("lit", text[i:j]))
            i = j
        elif text.startswith(OPERATORS, i):
            if word:
                yield word
                word = []
            op = next(o for o in OPERATORS if text.startswith(o, i))
            yield op
            i += len(op)
        else:
            word.append(("lit", c))
            i += 1
    if word:
        yield word


def _skip_dollar(text: str, i: int) -> int:
    """The index after the ``$...`` expansion that starts at ``text[i]`` (balanced ``${}``, ``$()``, ``$(())``)."""
    if i + 1 < len(text) and text[i + 1] in "{(":
        opening = text[i + 1]
        closing = "}" if opening == "{" else ")"
        depth, j = 0, i + 1
        while j < len(text):
            if text[j] == opening:
                depth += 1
            elif text[j] == closing:
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        raise ScriptError(f"unbalanced {text[i:i + 2]} in the script: {text[i:i + 40]!r}")
    m = re.compile(rf"{NAME}|[0-9@*#?$]").match(text, i + 1)
    return m.end() if m else i + 1


def _text(word: Word) -> str:
    """A word's source text without its quotes (for keywords: ``if``, ``then``, ``[[``)."""
    return "".join(t for _, t in word)


_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv, ast.Mod: operator.mod}


def _arith(expr: str) -> int:
    """Bash integer arithmetic (+ - * / %) on an expression whose variables are already substituted."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ScriptError(f"$(( {expr} )): only integer + - * / % are read; pass the arguments instead of the script")
    return ev(ast.parse(expr.strip(), mode="eval"))


class Shell:
    """Variables and arrays of one script's reading (values: str, or list for arrays)."""

    def __init__(self, positional: Sequence[str] = ()) -> None:
        self.vars: dict = {str(i + 1): v for i, v in enumerate(positional)}
        self.vars["PWD"] = os.getcwd()
        self.vars["#"] = str(len(positional))
        self.read_args: set = set()  # n of every $n expanded
        self.arg_names: dict = {}  # n -> the variable of `NAME=$n`

    def lookup(self, body: str) -> list:
        """The value of ``${body}`` as a list of strings (an array's elements; a scalar is one)."""
        m = re.fullmatch(rf"({NAME}|[0-9]+|#)(\[[@*]\])?(?::?([-=+])(.*))?", body, re.S)
        if not m:
            raise ScriptError(f"${{{body}}}: not a form this reader expands; pass the arguments instead of the script")
        name, index, op, alt = m.groups()
        if name.isdigit():
            self.read_args.add(int(name))
        value = self.vars.get(name)
        values = value if isinstance(value, list) else ([] if value is None else [value])
        is_set = bool(values) and values != [""]
        if op in ("-", "=") and not is_set:
            values = [self.expand_joined(alt)]
            if op == "=":
                self.vars[name] = values[0]
        elif op == "+":
            values = [self.expand_joined(alt)] if is_set else []
        return values if index else values[:1]

    def expand_joined(self, text: str) -> str:
        """``text`` expanded as one double-quoted word (a ``${X:-default}`` default, a ``$((...))`` body)."""
        fields = self.expand([part for w in _lex(text) if isinstance(w, list) for part in w + [("sq", " ")]][:-1])
        return " ".join(fields)

    def _expand_part(self, text: str) -> list:
        """Expansions of one part's text: [str | list]; a list holds an array's ``[@]`` elements."""
        out: list = []
        i = 0
        while i < len(text):
            if text[i] == "\\" and i + 1 < len(text):
                out.append(text[i + 1])
                i += 2
            elif text[i] == "$":
                j = _skip_dollar(text, i)
                token = text[i:j]
                if token.startswith("$(("):
                    inner = re.sub(rf"\$\{{?({NAME})\}}?", lambda m: (self.lookup(m.group(1)) or ["0"])[0], token[3:-2])
                    inner = re.sub(rf"\b({NAME})\b", lambda m: (self.lookup(m.group(1)) or ["0"])[0], inner)
                    out.append(str(_arith(inner)))
                elif token.startswith("$("):
                    out.append(token)  # command substitution: not run
                elif token.startswith("${"):
                    body = token[2:-1]
                    values = self.lookup(body)
                    out.append(values if re.search(r"\[[@*]\]", body) else "".join(values))
                elif token == "$":
                    out.append("$")
                else:
                    out.append("".join(self.lookup(token[1:])))
                i = j
            else:
                out.append(text[i])
                i += 1
        return out

    def expand(self, word: Word, *, split: bool = True) -> list:
        """The fields (arguments) one word expands to: expansion, then word splitting of unquoted parts
        (none with ``split=False``: the value of an assignment)."""
        fields: list = []
        current: Optional[str] = None  # None: no field started (an unquoted empty expansion adds nothing)

        def add(s: str, split: bool) -> None:
            nonlocal current
            if not split:
                current = (current or "") + s
                return
            pieces = re.split(r"[ \t\n]+", s)
            for k, piece in enumerate(pieces):
                if k > 0 and current is not None:
                    fields.append(current)
                    current = None
                if piece:
                    current = (current or "") + piece

        for kind, text in word:
            if kind == "sq":
                add(text, split=False)
                continue
            for piece in self._expand_part(text):
                if isinstance(piece, list):  # ${ARR[@]}: one field per element when quoted
                    for k, element in enumerate(piece):
                        if kind == "dq" and k > 0:  # "${ARR[@]}": each element its own field
                            fields.append(current or "")
                            current = ""
                        elif k > 0:  # unquoted: elements joined by a space, then split
                            add(" ", split=split)
                        add(element, split=split and kind == "lit")
                    if kind == "dq" and not piece and current is None:
                        continue
                else:
                    add(piece, split=split and kind == "lit")
        if current is not None:
            fields.append(current)
        return fields


def _commands(tokens: list) -> Iterator:
    """Simple commands: (list of words, the operator that ended it)."""
    words: list = []
    for tok in tokens:
        if isinstance(tok, list):
            words.append(tok)
        elif tok == "(" and words and ASSIGN.match(_text(words[-1])) and _text(words[-1]).endswith("="):
            words.append("(")  # array assignment: its elements follow until ")"
        elif tok == ")" and "(" in words:
            words.append(")")
        elif tok == "\n" and "(" in words and ")" not in words:
            continue  # an array spans lines
        else:
            yield words, tok
            words = []
    if words:
        yield words, "\n"


def _test(shell: Shell, words: list) -> bool:
    """One ``[[ ... ]]`` / ``[ ... ]`` test (its words between the brackets)."""
    args = [" ".join(shell.expand(w)) if isinstance(w, list) else w for w in words]
    negate = bool(args) and args[0] == "!"
    args = args[1:] if negate else args
    if len(args) == 3 and args[1] in ("==", "=", "!="):
        result = (args[0] == args[2]) != (args[1] == "!=")
    elif len(args) == 2 and args[0] in ("-z", "-n"):
        result = (args[1] == "") == (args[0] == "-z")
    elif len(args) == 2 and args[0] in ("-f", "-d", "-e"):
        result = {"-f": os.path.isfile, "-d": os.path.isdir, "-e": os.path.exists}[args[0]](args[1])
    elif len(args) == 1:
        result = args[0] != ""
    else:
        raise ScriptError(f"the test [[ {' '.join(args)} ]] is not one this reader evaluates; "
                          f"pass the arguments instead of the script")
    return result != negate


def _condition(shell: Shell, words: list) -> bool:
    """An ``if`` condition: bracket tests joined by ``&&`` / ``||`` (left to right, as bash)."""
    result, join, i = None, None, 0
    texts = [_text(w) if isinstance(w, list) else w for w in words]
    while i < len(words):
        if texts[i] in ("[[", "["):
            end = texts.index("]]" if texts[i] == "[[" else "]", i)
            value = _test(shell, words[i + 1:end])
            i = end + 1
        elif texts[i] in ("&&", "||"):
            join = texts[i]
            i += 1
            continue
        else:
            raise ScriptError(f"the if condition {' '.join(texts)!r} is not a bracket test; "
                              f"pass the arguments instead of the script")
        result = value if result is None else (result and value if join == "&&" else result or value)
    return bool(result)


def read_script(text: str, positional: Sequence[str] = ()) -> Launch:
    """The launch command of a launch script's ``text``, its variables set as the script sets them.

    Args:
        text: the script.
        positional: the script's own arguments ($1, $2, ...).
    Raises:
        ScriptError: a construct this reader does not interpret, or no ``*.py`` launch in the script.
    """
    shell = Shell(positional)
    launches: list = []
    commands = list(_commands(list(_lex(text))))
    _run(shell, commands, 0, len(commands), launches)
    if not launches:
        raise ScriptError("no command of the script runs a .py program (pretrain_gpt.py); "
                          "pass Megatron's arguments instead: python -m mptrain.from_megatron -- --num-layers ...")
    arguments = tuple(shell.arg_names.get(n, f"ARG{n}") for n in range(1, max(shell.read_args, default=0) + 1))
    return dataclasses.replace(launches[-1], arguments=arguments, given=len(positional))


def _block_end(commands: list, start: int) -> list:
    """Indices of this ``if``'s ``elif`` / ``else`` / ``fi`` commands (nested ifs skipped)."""
    depth, marks = 0, []
    for k in range(start, len(commands)):
        first = _text(commands[k][0][0]) if commands[k][0] else ""
        if first == "if":
            depth += 1
        elif first == "fi":
            depth -= 1
            if depth == 0:
                return marks + [k]
        elif first in ("elif", "else") and depth == 1:
            marks.append(k)
    raise ScriptError("an if without its fi")


def _run(shell: Shell, commands: list, start: int, stop: int, launches: list) -> None:
    k = start
    while k < stop:
        words, _ = commands[k]
        first = _text(words[0]) if words and isinstance(words[0], list) else ""
        if first == "if":
            marks = _block_end(commands, k)
            branches, cond_at = [], k
            for mark in marks:
                branches.append((cond_at, mark))
                cond_at = mark
            for cond_start, branch_end in branches:
                head = commands[cond_start][0]
                keyword = _text(head[0])
                if keyword == "else":
                    _run(shell, commands, cond_start + 1, branch_end, launches)
                    break
                # `if [[ a ]] || [[ b ]]; then`: the condition may span commands joined by && / ||
                cond, j = list(head[1:]), cond_start
                while not _starts_with(commands[j + 1][0], "then"):
                    cond += [commands[j][1]] + list(commands[j + 1][0])
                    j += 1
                then = commands[j + 1][0]
                body_start = j + 1
                if _condition(shell, cond):
                    commands[body_start] = (then[1:], commands[body_start][1])  # `then X` runs X
                    _run(shell, commands, body_start, branch_end, launches)
                    commands[body_start] = (then, commands[body_start][1])
                    break
            k = marks[-1] + 1
            continue
        _simple(shell, words, launches)
        k += 1


def _starts_with(words: list, keyword: str) -> bool:
    return bool(words) and isinstance(words[0], list) and _text(words[0]) == keyword


def _is_assignment(word) -> bool:
    return isinstance(word, list) and word[0][0] == "lit" and bool(ASSIGN.match(_text(word)))


LAUNCHERS = re.compile(r"^(torchrun|python[0-9.]*|srun|mpirun|deepspeed)$")
"""The first word of a launch command (``python -m torch.distributed.run ... pretrain_gpt.py`` included)."""


def _simple(shell: Shell, words: list, launches: list) -> None:
    if words and _text(words[0]) in ("export", "local", "declare", "readonly"):
        words = [w for w in words[1:] if not (isinstance(w, list) and _text(w).startswith("-"))]
    if words and _is_assignment(words[0]) and (len(words) == 1 or words[1] == "("):
        _assign(shell, words)
        return
    while words and _is_assignment(words[0]):  # `VAR=v cmd ...`: VAR is set for that command only
        words = words[1:]
    fields = [f for w in words if isinstance(w, list) for f in shell.expand(w)]
    if not fields or not LAUNCHERS.match(os.path.basename(fields[0])):
        return  # mkdir, echo, exit, set ...: not run
    script_at = next((i for i, f in enumerate(fields) if f.endswith(".py") and " " not in f), None)
    if script_at is not None:
        launches.append(Launch(launcher=fields[:script_at], script=fields[script_at], args=fields[script_at + 1:]))


def _assign(shell: Shell, words: list) -> None:
    """``X=value``, ``X+=value``, ``X=( elements )``, ``X+=( elements )``."""
    first = words[0]
    m = ASSIGN.match(_text(first))
    name, append = m.group(1), bool(m.group(2))
    if len(words) > 1 and words[1] == "(":
        end = words.index(")")
        elements = [f for w in words[2:end] for f in shell.expand(w)]
        old = shell.vars.get(name, [])
        old = old if isinstance(old, list) else [old]
        shell.vars[name] = (old + elements) if append else elements
        return
    value_word = _strip_name(first, m.end())
    ref = re.fullmatch(r"\$\{?([0-9])(?:[:}].*)?", _text(value_word), re.S)
    if ref:  # `CHECKPOINT_PATH=$1`: the name of the script's first argument, for its usage line
        shell.arg_names.setdefault(int(ref.group(1)), name)
    value = "".join(shell.expand(value_word + [("sq", "")], split=False))
    old = shell.vars.get(name, "")
    shell.vars[name] = ((old[0] if isinstance(old, list) and old else old or "") + value) if append else value


def _strip_name(word: Word, n: int) -> Word:
    """``word`` without its first ``n`` characters (the ``NAME=`` of an assignment), parts kept."""
    out, skip = [], n
    for kind, text in word:
        if skip >= len(text):
            skip -= len(text)
            continue
        out.append((kind, text[skip:]))
        skip = 0
    return out
