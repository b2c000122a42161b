"""One tokenizer interface for encoder pretraining, over the tokenizers Megatron-Core supports.

Kinds (Megatron-Core ``--tokenizer-type`` names):

- ``HuggingFaceTokenizer``: a local directory (``tokenizer.json`` + ``tokenizer_config.json``), a
  bare ``tokenizer.json`` file, or a hub id when the hub is reachable. This includes the byte-level
  BPE tokenizers written by ``tools/train_tokenizer.py``.
- ``SentencePieceTokenizer`` (aliases ``Llama2Tokenizer``, ``GPTSentencePieceTokenizer``): a
  SentencePiece ``.model`` file.
- ``GPT2BPETokenizer``: GPT-2 style byte-level BPE from ``vocab_file`` (vocab.json) + ``merge_file``
  (merges.txt).

Token ids equal those of Megatron-Core's own tokenizer (``tokenize`` with
``add_special_tokens=True``), so datasets made here and with Megatron-LM's preprocessing agree.
Special-token roles follow Megatron-Core too: EOD is the eos token (a HF tokenizer without eos
uses sep, e.g. BERT's ``[SEP]``); BOS is the bos token (else cls). A missing role never breaks
construction (a decoder tokenizer without a mask token is fine for preprocessing); reading it
raises :class:`MissingSpecialTokenError` with the fix.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config_loading import UserError

HUGGINGFACE = "HuggingFaceTokenizer"
SENTENCEPIECE = "SentencePieceTokenizer"
GPT2BPE = "GPT2BPETokenizer"
# Megatron-Core accepts these names for SentencePiece models; they behave identically here.
_ALIASES = {
    HUGGINGFACE: HUGGINGFACE,
    SENTENCEPIECE: SENTENCEPIECE,
    "Llama2Tokenizer": SENTENCEPIECE,
    "GPTSentencePieceTokenizer": SENTENCEPIECE,
    GPT2BPE: GPT2BPE,
}
TOKENIZER_TYPES: tuple[str, ...] = tuple(_ALIASES)

GPT2_EOD = "<|endoftext|>"
TRAIN_HINT = "train one with `python tools/train_tokenizer.py --input CORPUS --output-dir DIR`"
WORD_MARKS = ("Ġ", "▁", "##")
"""How vocabularies mark words: a word's first piece (byte-level BPE 'Ġ', SentencePiece '▁') or
its continuations (WordPiece '##')."""
WORD_MARK_MIN_SHARE = 0.02
"""The share of pieces that must carry a mark for ``EncoderTokenizer.word_mark`` to read one: 19 %
of BERT's WordPiece, about half of a SentencePiece or byte-level BPE vocabulary, none of a BPE
trained behind a whitespace pre-tokenizer."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class MissingSpecialTokenError(UserError):
    """The tokenizer has no token for a role (mask, pad, eod, bos) that the caller needs."""


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """Which tokenizer to build; field names and values follow Megatron-Core's arguments."""

    tokenizer_type: str | None = None
    """``HuggingFaceTokenizer``, ``SentencePieceTokenizer`` (or ``Llama2Tokenizer`` /
    ``GPTSentencePieceTokenizer``) or ``GPT2BPETokenizer``. None: inferred, a directory or ``.json``
    or hub id is HF, a ``.model`` (or ``.model.v1``...) is SentencePiece, ``vocab_file`` +
    ``merge_file`` is GPT-2 BPE."""
    tokenizer_model: str | None = None
    """HF tokenizer directory, ``tokenizer.json`` or hub id; or a SentencePiece ``.model`` file."""
    vocab_file: str | None = None
    """GPT-2 BPE ``vocab.json`` (token -> id); only with ``GPT2BPETokenizer``."""
    merge_file: str | None = None
    """GPT-2 BPE ``merges.txt``; only with ``GPT2BPETokenizer``."""

    def __post_init__(self) -> None:
        if self.tokenizer_type is not None and self.tokenizer_type not in _ALIASES:
            raise UserError(
                f"tokenizer_type {self.tokenizer_type!r} is not supported; valid: {list(TOKENIZER_TYPES)} "
                "(or None to infer it from tokenizer_model / vocab_file)"
            )


class EncoderTokenizer(abc.ABC):
    """Text <-> ids, plus the special-token ids that Megatron datasets and MLM masking need."""

    vocab_size: int
    """Embedding rows needed: the largest id + 1, added tokens included."""
    special_ids: frozenset[int]
    """Every special/control id of the tokenizer; MLM never masks these."""

    def __init__(
        self,
        *,
        config: TokenizerConfig,
        vocab_size: int,
        special_ids: frozenset[int],
        roles: dict[str, int | None],
    ) -> None:
        self._config = config
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self._roles = roles

    @property
    def name(self) -> str:
        """Short description used in messages, e.g. ``SentencePieceTokenizer '/x/tok.model'``."""
        c = self._config
        where = c.tokenizer_model if c.tokenizer_model is not None else f"{c.vocab_file} + {c.merge_file}"
        return f"{c.tokenizer_type} {where!r}"

    def _role(self, role: str) -> int:
        token_id = self._roles[role]
        if token_id is None:
            raise MissingSpecialTokenError(f"tokenizer {self.name} has no {role} token; {self._fix(role)}")
        return token_id

    @abc.abstractmethod
    def _fix(self, role: str) -> str:
        """How the user gets a token for ``role`` with this kind of tokenizer."""

    @property
    def eod(self) -> int:
        """End-of-document id appended between documents (the eos token)."""
        return self._role("eod")

    @property
    def pad(self) -> int:
        """Padding id. Never defaulted: pad = eos is a convention the caller must choose."""
        return self._role("pad")

    @property
    def mask(self) -> int:
        """The ``<mask>`` id that MLM writes over masked positions."""
        return self._role("mask")

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id (cls for BERT-style HF tokenizers)."""
        return self._role("bos")

    @abc.abstractmethod
    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``. ``add_special_tokens=True`` gives exactly Megatron-Core's ``tokenize``:
        the HF post-processor's tokens (e.g. BOS, or [CLS] ... [SEP]); SentencePiece and GPT-2 BPE
        add nothing in Megatron-Core, so they add nothing here either."""

    @abc.abstractmethod
    def tokenize_batch(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """``[tokenize(t) for t in texts]`` through the library's batch path (faster)."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are kept, as in Megatron-Core's ``detokenize``."""

    def reference(self) -> dict:
        """JSON-able description; ``build_tokenizer(TokenizerConfig(**ref))`` rebuilds this tokenizer."""
        return dataclasses.asdict(self._config)

    @abc.abstractmethod
    def _pieces(self) -> list[str]:
        """Every id's token string, in id order."""

    def word_mark(self) -> str | None:
        """The word mark most of the vocabulary's pieces carry ('Ġ' byte-level BPE, '▁'
        SentencePiece, '##' WordPiece continuations), or None when none is carried by at least
        :data:`WORD_MARK_MIN_SHARE` of them: a vocabulary trained behind a whitespace
        pre-tokenizer without marks, whose ids do not say where words begin."""
        pieces = self._pieces()
        counts = {mark: sum(piece.startswith(mark) for piece in pieces) for mark in WORD_MARKS}
        mark = max(WORD_MARKS, key=counts.__getitem__)
        return mark if counts[mark] >= WORD_MARK_MIN_SHARE * len(pieces) else None

    def word_boundaries(self) -> tuple[list[bool], list[bool]]:
        """Per id, ``(starts, ends)`` for whole-word masking, BERT's words: text split at
        whitespace, around every punctuation character and around each CJK ideograph.

        A token *starts* a word when it carries the vocabulary's word mark (byte-level BPE 'Ġ',
        SentencePiece '▁'; WordPiece marks continuations with '##' instead) or its text begins
        with punctuation, whitespace (a newline 'Ċ') or an ideograph; it *ends* one when its text
        ends with one of those and is not whitespace alone, so the token after it starts the next
        (``"(", "hello"``). Special tokens do both. The convention is the mark most pieces carry (a
        BPE vocabulary may hold a literal '##' token, a WordPiece one a 'Ġ' character).

        A byte-level piece holding part of a multi-byte character (the 'Ã' and '©' of 'é') reads
        as a letter, so punctuation or an ideograph that the vocabulary splits into bytes (an em
        dash in a small vocabulary) does not split words: a limit of reading pieces one by one.

        A vocabulary without word marks (:meth:`word_mark` None) raises ``UserError``."""
        mark = self.word_mark()
        if mark is None:
            raise UserError(f"tokenizer {self.name}: its pieces carry no word mark ({', '.join(WORD_MARKS)}), so "
                            "its ids do not say where words begin")
        pieces = self._pieces()
        starts, ends = [], []
        for piece in pieces:
            marked = piece.startswith(mark)
            text = _piece_text(piece, mark)
            starts.append(marked != (mark == "##") or (text != "" and _splits_words(text[0])))
            # Whitespace alone ('Ġ', '▁', 'Ċ') starts the word after it rather than being one.
            ends.append(text.strip() != "" and _splits_words(text[-1]))
        for special in self.special_ids:
            starts[special] = ends[special] = True
        return starts, ends

    def special_tokens(self) -> dict[str, str | None]:
        """Each special role's token (None: the tokenizer has none), as a dataset's tokenizer record
        shows it (``data.provenance``)."""
        pieces = self._pieces()
        return {role: None if token_id is None else pieces[token_id] for role, token_id in self._roles.items()}

    def fingerprint(self) -> str:
        """A hash of what the ids mean (every id's token and the special roles), not of where the
        files are: two tokenizers with the same fingerprint give weights the same meaning."""
        import hashlib
        import json

        if getattr(self, "_fingerprint", None) is None:  # the whole vocabulary: computed once
            content = {"pieces": self._pieces(), "roles": self._roles, "special": sorted(self.special_ids)}
            self._fingerprint = hashlib.sha256(json.dumps(content, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
        return self._fingerprint

    @property
    def unique_identifiers(self) -> dict:
        """What Megatron-Core's datasets hash (with their config) to key their index caches."""
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, **self.reference()}


class _TokenizersBackend(EncoderTokenizer):
    """Tokenizers backed by a Rust ``tokenizers.Tokenizer`` (HF fast tokenizers, GPT-2 BPE)."""

    def __init__(self, backend, **kwargs) -> None:
        # Some tokenizer.json files ship with truncation/padding enabled (all-MiniLM: 128 tokens);
        # transformers turns them off per call, and pretraining documents must never be cut.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        super().__init__(**kwargs)

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _pieces(self) -> list[str]:
        pieces = [""] * self.vocab_size
        for token, index in self._backend.get_vocab(with_added_tokens=True).items():
            pieces[index] = token
        return pieces

    def tokenize_batch(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        encodings = self._backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)


class HuggingFaceTokenizer(_TokenizersBackend):
    """A ``transformers`` fast tokenizer: roles come from its tokenizer_config/special tokens."""

    def __init__(self, config: TokenizerConfig) -> None:
        hf = _load_transformers_tokenizer(config.tokenizer_model)
        if getattr(hf, "backend_tokenizer", None) is None:
            raise UserError(
                f"tokenizer_model {config.tokenizer_model!r} loads as {type(hf).__name__}, which has no "
                "tokenizers backend (tokenizer.json); save it as a fast tokenizer, or pass its "
                "SentencePiece .model with tokenizer_type SentencePieceTokenizer"
            )

        def token_id(token: str | None) -> int | None:
            return None if token is None else hf.convert_tokens_to_ids(token)

        self._eos_token = hf.eos_token
        eos, sep = token_id(hf.eos_token), token_id(hf.sep_token)
        bos, cls = token_id(hf.bos_token), token_id(hf.cls_token)
        backend = hf.backend_tokenizer
        added_special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        super().__init__(
            backend,
            config=config,
            vocab_size=max(backend.get_vocab(with_added_tokens=True).values()) + 1,
            special_ids=frozenset(set(hf.all_special_ids) | added_special),
            # eos else sep, bos else cls: the fallbacks of Megatron-Core's HuggingFaceTokenizer.
            roles={
                "eod": eos if eos is not None else sep,
                "bos": bos if bos is not None else cls,
                "pad": token_id(hf.pad_token),
                "mask": token_id(hf.mask_token),
            },
        )

    def _fix(self, role: str) -> str:
        model = self._config.tokenizer_model
        if Path(model).is_file():
            edit = f"tok = transformers.PreTrainedTokenizerFast(tokenizer_file={model!r}); "
        else:
            edit = f"tok = transformers.AutoTokenizer.from_pretrained({model!r}); "
        save = "tok.save_pretrained(NEW_DIR); then use tokenizer_model=NEW_DIR"
        if role == "mask":
            return (
                f"{TRAIN_HINT}, or add one (a token new to the vocab adds an embedding row): "
                f"{edit}tok.add_special_tokens({{'mask_token': '<mask>'}}); {save}"
            )
        if role == "pad" and self._eos_token is not None:
            return (
                f"it has eos {self._eos_token!r} (id {self._roles['eod']}): callers that follow the "
                "Llama-3/EuroBERT convention pad with eos (use `tokenizer.eod`), or make it the pad token: "
                f"{edit}tok.pad_token = tok.eos_token; {save}"
            )
        attr = {"eod": "eos_token", "bos": "bos_token", "pad": "pad_token"}[role]
        spelled = {"eod": "</s>", "bos": "<s>", "pad": "<pad>"}[role]
        return f"{edit}tok.add_special_tokens({{'{attr}': '{spelled}'}}); {save}"


class SentencePieceTokenizer(EncoderTokenizer):
    """A SentencePiece model; roles are the model's bos/eos/pad ids (it has no mask role)."""

    def __init__(self, config: TokenizerConfig) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=config.tokenizer_model)
        sp = self._sp
        n = sp.get_piece_size()

        def role(token_id: int) -> int | None:
            return token_id if token_id >= 0 else None  # SentencePiece marks absent roles with -1

        super().__init__(
            config=config,
            vocab_size=n,
            special_ids=frozenset(i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)),
            roles={
                "eod": role(sp.eos_id()),
                "bos": role(sp.bos_id()),
                "pad": role(sp.pad_id()),
                "mask": None,
            },
        )

    def _pieces(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        return self._sp.encode(texts)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def _fix(self, role: str) -> str:
        if role == "mask":
            # Not "convert it to HF and add one": transformers 5's SentencePiece conversion of
            # Mistral's tokenizer.model.v1 tokenizes 43 of 300 Lee-corpus articles differently.
            return (
                f"SentencePiece models have no mask role; {TRAIN_HINT}, or use a Hugging Face "
                "tokenizer directory whose tokenizer_config.json sets mask_token"
            )
        if role == "pad" and self._roles["eod"] is not None:
            return (
                f"it was trained with pad_id=-1. It has eos id {self._roles['eod']}: callers that follow the "
                "Llama-3/EuroBERT convention pad with eos (use `tokenizer.eod`); or retrain it with --pad_id"
            )
        flag = {"eod": "--eos_id", "bos": "--bos_id", "pad": "--pad_id"}[role]
        return f"it was trained with {flag}=-1; retrain it with {flag} set, or {TRAIN_HINT}"


class GPT2BPETokenizer(_TokenizersBackend):
    """GPT-2 byte-level BPE from vocab.json + merges.txt; eod = bos = ``<|endoftext|>``."""

    def __init__(self, config: TokenizerConfig) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        # The same pipeline as transformers' GPT2Tokenizer, which Megatron-Core's GPT2BPETokenizer wraps.
        backend = Tokenizer(models.BPE.from_file(config.vocab_file, config.merge_file))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        eod = backend.token_to_id(GPT2_EOD)
        if eod is not None:
            backend.add_special_tokens([AddedToken(GPT2_EOD, special=True, normalized=False)])
        super().__init__(
            backend,
            config=config,
            vocab_size=max(backend.get_vocab(with_added_tokens=True).values()) + 1,
            special_ids=frozenset() if eod is None else frozenset({eod}),
            roles={"eod": eod, "bos": eod, "pad": None, "mask": None},
        )

    def _fix(self, role: str) -> str:
        if role in ("eod", "bos"):
            return f"vocab_file {self._config.vocab_file!r} has no {GPT2_EOD!r} entry; add it to the vocab"
        return (
            f"GPT-2 BPE files carry no {role} token; {TRAIN_HINT}, or load them with "
            f"tok = transformers.GPT2Tokenizer(vocab={self._config.vocab_file!r}, "
            f"merges={self._config.merge_file!r}), tok.add_special_tokens({{'{role}_token': '<{role}>'}}), "
            "tok.save_pretrained(NEW_DIR) and use HuggingFaceTokenizer with tokenizer_model=NEW_DIR"
        )


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte pieces


@functools.cache
def _byte_level_decoder():
    from tokenizers import decoders

    return decoders.ByteLevel()


def _piece_text(piece: str, mark: str) -> str:
    """The text a vocabulary piece stands for, with its word mark as a space ('##' dropped); a
    partial UTF-8 character reads as U+FFFD."""
    if mark == "Ġ":  # GPT-2's byte alphabet ('Ġ' the space, 'Ċ' the newline); added tokens stay as written
        return _byte_level_decoder().decode([piece])
    if mark == "##":
        return piece.removeprefix("##")
    fallback = _BYTE_FALLBACK.match(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)]).decode("utf-8", errors="replace")
    return piece.replace("▁", " ")


_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
"""CJK ideographs, each a word of its own in BERT's basic tokenizer (its ``_is_chinese_char``)."""


def _splits_words(character: str) -> bool:
    """Whitespace, punctuation or a CJK ideograph (BERT's rules: every non-alphanumeric printable
    ASCII character and Unicode's P* categories are punctuation); U+FFFD, part of a split
    character, is not."""
    if character.isspace():
        return True
    code = ord(character)
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    if any(low <= code <= high for low, high in _CJK_RANGES):
        return True
    return unicodedata.category(character).startswith("P")


def _load_transformers_tokenizer(model: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # slow import: only HF needs it

    path = Path(model)
    try:
        if path.is_file():
            # A tokenizer.json next to its tokenizer_config.json is that directory's tokenizer: the
            # config names the special-token roles, which a bare tokenizer.json does not.
            if path.name == "tokenizer.json" and (path.parent / "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(str(path.parent))
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        if not path.exists():  # a mistyped or not yet built local path reads as a hub id: say both
            raise UserError(f"tokenizer_model {model!r}: no such file or directory ({path.resolve()}), and as a "
                            f"Hugging Face hub id transformers could not load it: {err}") from err
        raise UserError(f"tokenizer_model {model!r}: transformers could not load it: {err}") from err


def is_hub_id(model: str) -> bool:
    """Whether ``model`` names a Hugging Face hub repository rather than a local path: not a path
    that exists, nor one whose folder exists here (``data/demo_tokenizer`` before ``make demo-data``
    has a hub id's shape, but ``data/`` is a local folder)."""
    path = Path(model)
    return not path.exists() and _HUB_ID.match(model) is not None and not _missing_in_local_folder(path)


def _missing_in_local_folder(path: Path) -> bool:
    return len(path.parts) > 1 and path.parent.is_dir() and not path.exists()


def _check_local_path(model: str) -> None:
    """A missing path in a folder that exists is refused here, naming what the folder holds: asked
    as a hub id, an offline cluster would retry the hub for minutes before failing."""
    path = Path(model)
    if _missing_in_local_folder(path):
        held = sorted(entry.name for entry in path.parent.iterdir())
        shown = ", ".join(held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "") or "nothing"
        raise UserError(f"tokenizer_model {model!r} does not exist ({path.resolve()}); {path.parent}/ holds: {shown}")


def _resolve(config: TokenizerConfig) -> TokenizerConfig:
    """Fill in the canonical tokenizer_type, make local paths absolute, check the fields."""
    model, vocab, merges = config.tokenizer_model, config.vocab_file, config.merge_file
    kind = _ALIASES.get(config.tokenizer_type) if config.tokenizer_type else None
    if model is not None:
        _check_local_path(model)
    if kind is None:
        if model is not None:
            if ".model" in Path(model).suffixes:  # also versioned names like tokenizer.model.v1
                kind = SENTENCEPIECE
            elif Path(model).is_dir() or model.endswith(".json") or is_hub_id(model):
                kind = HUGGINGFACE
            else:
                raise UserError(
                    f"cannot infer tokenizer_type from tokenizer_model {model!r}: expected a directory, "
                    "a .json, a hub id or a SentencePiece .model; or set tokenizer_type"
                )
        elif vocab is not None or merges is not None:
            kind = GPT2BPE
        else:
            raise UserError("no tokenizer given: set tokenizer_model, or vocab_file and merge_file")

    needed = {"tokenizer_model": model} if kind != GPT2BPE else {"vocab_file": vocab, "merge_file": merges}
    unused = {"vocab_file": vocab, "merge_file": merges} if kind != GPT2BPE else {"tokenizer_model": model}
    for field, value in needed.items():
        if value is None:
            raise UserError(f"{kind} needs {field}")
    for field, value in unused.items():
        if value is not None:
            raise UserError(f"{kind} does not use {field} (got {value!r}); needs {sorted(needed)}")

    resolved = {}
    for field, value in needed.items():
        if kind == HUGGINGFACE and is_hub_id(value):
            resolved[field] = value  # a hub id stays as it is
        elif not Path(value).exists():
            raise UserError(f"{field} {value!r} does not exist")
        else:
            resolved[field] = str(Path(value).resolve())
    if kind == SENTENCEPIECE and not Path(resolved["tokenizer_model"]).is_file():
        raise UserError(f"tokenizer_model {model!r} must be a SentencePiece .model file")
    return TokenizerConfig(tokenizer_type=kind, **resolved)


def build_tokenizer(config: TokenizerConfig) -> EncoderTokenizer:
    """Build the tokenizer described by ``config`` (see :class:`TokenizerConfig`)."""
    config = _resolve(config)
    classes = {
        HUGGINGFACE: HuggingFaceTokenizer,
        SENTENCEPIECE: SentencePieceTokenizer,
        GPT2BPE: GPT2BPETokenizer,
    }
    return classes[config.tokenizer_type](config)
