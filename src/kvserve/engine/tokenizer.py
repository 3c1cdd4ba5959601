"""Loading a model's tokenizer and turning chat messages into prompt token ids.

Both a GGUF file (the tokenizer is stored inside it; transformers rebuilds a fast
tokenizer from the metadata) and a Hugging Face model folder (``tokenizer.json`` /
``tokenizer_config.json``) are supported, always from local files only.

Chat prompts use the tokenizer's own Jinja chat template: the template is rendered to
text and then encoded with ``add_special_tokens=False`` (the template already writes
the special tokens), which gives the same ids as transformers'
``apply_chat_template(..., tokenize=True)``.

A GGUF file's tokenizer is rebuilt from its metadata once (1.8 s for SmolLM2's 49k tokens,
21 s for Gemma 3's 262k on the 2-core test machine) and kept on disk as a Hugging Face
tokenizer (``save_pretrained``) under ``$KVSERVE_CACHE_DIR/tokenizers`` (default
``$XDG_CACHE_HOME/kvserve`` or ``~/.cache/kvserve``), one entry per file path, size and
modification time, inode and transformers / tokenizers version; later loads read that entry
(0.2 s and 3.3 s). ``KVSERVE_CACHE_DIR=off`` turns the cache off; an unwritable or damaged
cache is skipped (the tokenizer is rebuilt), never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Files whose presence marks a folder as holding a Hugging Face tokenizer.
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model from local files.

    Args:
        model_path: a ``.gguf`` file, or a folder with a Hugging Face tokenizer
            (``tokenizer.json`` / ``tokenizer_config.json`` ...), or a folder holding
            exactly one ``.gguf`` file and no Hugging Face tokenizer files.

    Returns:
        A transformers tokenizer (fast, Rust-backed where available).

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        ValueError: no tokenizer can be found or loaded at ``model_path`` (the message
            names the path and the cause).

    Loading a GGUF tokenizer takes a few seconds (the vocabulary is rebuilt from the
    metadata): load it once per engine.
    """
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer: {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"cannot load a tokenizer from {str(path)!r}: expected a .gguf file "
                "or a Hugging Face model folder"
            )
        return _load_gguf(path)
    if any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises many kinds; name the path
            raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {e}") from e
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0])
    found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
    raise ValueError(
        f"no tokenizer found in {str(path)!r}: expected one of {', '.join(_HF_TOKENIZER_FILES)} "
        f"or a single .gguf file ({found} there)"
    )


#: Gemma's chat format (text only), as Gemma 3's own template writes it: BOS, a system
#: message merged into the first user turn, ``<start_of_turn>{user|model}\n...<end_of_turn>\n``.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


#: Bumped when what a tokenizer cache entry holds changes (older entries are then ignored).
_TOKENIZER_CACHE_VERSION = 1


def cache_dir() -> Path | None:
    """kvserve's on-disk cache folder: ``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve``,
    else ``~/.cache/kvserve``; None when ``KVSERVE_CACHE_DIR`` is ``off`` (or ``0``/``none``)."""
    env = os.environ.get("KVSERVE_CACHE_DIR")
    if env is not None and env.strip().lower() in ("off", "0", "none", ""):
        return None
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvserve"


def _gguf_cache_entry(path: Path) -> Path | None:
    """The cache folder of this GGUF file's tokenizer (it may not exist yet): keyed by the
    resolved path, size, modification time (ns) and inode, and by the transformers and
    tokenizers versions that built it. None when the cache is off or the file cannot be read."""
    root = cache_dir()
    if root is None:
        return None
    try:
        import tokenizers
        import transformers

        st = path.stat()
        key = json.dumps([_TOKENIZER_CACHE_VERSION, str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino,
                          transformers.__version__, tokenizers.__version__])
    except (OSError, ImportError):
        return None
    return root / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _load_cached(entry: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in ``entry``, or None when there is none or it cannot be read."""
    try:
        config = json.loads((entry / "tokenizer_config.json").read_text())
        if config.get("tokenizer_class") == "TokenizersBackend":
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(entry), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
    except Exception:  # missing, partly written by hand, or from an incompatible build: rebuild
        return None


def _save_cached(tok: PreTrainedTokenizerBase, entry: Path) -> None:
    """Write ``tok`` to ``entry`` atomically: a temporary folder renamed into place, after removing
    an entry that could not be loaded (if another process renames its own copy in first, the
    rename fails and that copy stays: they hold the same tokenizer). Any failure leaves at most
    a complete entry and is not an error."""
    tmp = entry.parent / f".{entry.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(tmp))
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)  # a damaged entry (a good one loaded before)
        os.rename(tmp, entry)
    except Exception:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(path: Path) -> PreTrainedTokenizerBase:
    entry = _gguf_cache_entry(path)
    tok = _load_cached(entry) if entry is not None else None
    if tok is None:
        tok = _build_gguf(path)
        if entry is not None:
            _save_cached(tok, entry)
    tok.name_or_path = str(path.parent)
    if not getattr(tok, "chat_template", None) and _has_tokens(tok, "<start_of_turn>", "<end_of_turn>"):
        # Gemma GGUFs converted without their template (llama.cpp falls back the same way)
        tok.chat_template = GEMMA_CHAT_TEMPLATE
    return tok


def _build_gguf(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer transformers rebuilds from the GGUF file's metadata."""
    try:
        if _gguf_tokenizer_is_backend(path):
            # What AutoTokenizer returns for these files, without its model-config step: that
            # parses the whole GGUF again with the gguf package (~4.5 s on SmolLM2) and imports
            # the Auto* machinery (~2 s) only to choose this class.
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            tok = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from the GGUF file {str(path)!r}: {e}") from e
    return tok


def _gguf_tokenizer_is_backend(path: Path) -> bool:
    """Whether ``AutoTokenizer`` builds a plain ``TokenizersBackend`` for this GGUF file: a
    ``llama`` file (transformers registers no tokenizer class for that model type; a name
    containing "mistral" makes it a Mistral, which does) with no ``tokenizer_config.json`` next
    to it that could name another class. Other files go through ``AutoTokenizer``."""
    from kvserve.worker.loader import gguf_metadata

    if (path.parent / "tokenizer_config.json").exists():
        return False
    try:
        meta = gguf_metadata(path)
    except ValueError:  # (unreadable: AutoTokenizer gives its own error)
        return False
    name = meta.get("general.name")
    return meta.get("general.architecture") == "llama" and not (isinstance(name, str) and "mistral" in name)


def _has_tokens(tok: PreTrainedTokenizerBase, *tokens: str) -> bool:
    vocab = tok.get_vocab()
    return all(t in vocab for t in tokens)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Render chat messages with the tokenizer's chat template and encode them.

    Args:
        tokenizer: a tokenizer with a ``chat_template``.
        messages: OpenAI-style messages, each a mapping with ``role`` (str) and
            ``content`` (str, or a list of content parts if the template accepts it);
            other keys (``name``, ``tool_calls`` ...) are passed to the template.
        add_generation_prompt: end with the header of an assistant turn (e.g.
            ``<|im_start|>assistant\\n``), so the model answers.
        tools: OpenAI-style tools, for templates that render them (others ignore them).
        chat_template: a Jinja template used instead of the tokenizer's (``--chat-template``).

    Returns:
        Prompt token ids (the template writes BOS / special tokens itself; no others
        are added).

    Raises:
        ValueError: empty ``messages``, a message that is not a mapping or lacks
            ``role`` / ``content``, a non-string role, or a tokenizer without a chat
            template.
    """
    _check_messages(messages)
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')!r}) "
            "has no chat template; send a plain prompt instead"
        )
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
        **({"tools": tools} if tools else {}), **({"chat_template": chat_template} if chat_template else {}),
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_template_renders_tools(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> bool:
    """Whether the tokenizer's chat template (or ``chat_template``, which replaces it) uses
    ``tools`` (a template that never mentions them, like SmolLM2's, drops the tools it is given).

    Returns:
        False without a chat template; for a dict of named templates, whether any mentions ``tools``.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return any(isinstance(t, str) and "tools" in t for t in template.values())
    if isinstance(template, list):  # (the serialized form: [{"name", "template"}])
        return any(isinstance(t, dict) and "tools" in str(t.get("template", "")) for t in template)
    return isinstance(template, str) and "tools" in template


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            raise ValueError(f"messages[{i}] lacks {' and '.join(repr(k) for k in missing)}")
        if not isinstance(m["role"], str) or not m["role"]:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {m['role']!r}")
        if not isinstance(m["content"], (str, list)):
            raise ValueError(
                f"messages[{i}]['content'] must be a string or a list of content parts, "
                f"got {type(m['content']).__name__}"
            )


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """Each bad word as token id sequences, with and without a leading space (vLLM's rule:
    a word is banned both at the start of the text and after a space).

    Raises:
        ValueError: an entry is not a non-empty string.
    """
    variants: list[str] = []
    for w in words:
        if not isinstance(w, str) or not w:
            raise ValueError(f"bad_words entries must be non-empty strings or token id lists, got {w!r}")
        variants += [w, " " + w.lstrip(" ")]
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    for ids in tokenizer(variants, add_special_tokens=False)["input_ids"] if variants else []:
        key = tuple(ids)
        if ids and key not in seen:  # first occurrence kept, in order (linear in the list)
            seen.add(key)
            out.append(list(ids))
    return out


def eos_token_ids(cfg, tokenizer) -> tuple[int, ...]:
    """The token ids that end generation: the model's EOS ids (its config, else the
    tokenizer's), plus Gemma's ``<end_of_turn>``, which ends a chat turn (its
    generation_config lists [1, 106]; a GGUF names only ``<eos>``)."""
    ids = tuple(cfg.eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    if cfg.architecture == "Gemma3ForCausalLM":
        eot = tokenizer.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(eot, int) and eot != tokenizer.unk_token_id and eot not in ids:
            ids += (eot,)
    return ids


def load_chat_template(value: str) -> str:
    """A chat template from ``--chat-template``: the contents of the file ``value`` names, or
    ``value`` itself when it is a Jinja template (it holds ``{{`` or ``{%``), as vLLM reads it.

    Raises:
        ValueError: ``value`` is neither an existing file nor a Jinja template, the file cannot
            be read, or the template is not valid Jinja (the message names ``--chat-template``
            and the line).
    """
    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {str(path)!r}: {e}") from None
        where = repr(str(path))
    elif "{{" in value or "{%" in value:
        template, where = value, "the template given"
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template (a template holds "
                         "'{{' or '{%')")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: {where} is not a valid Jinja template: {e.message} (line {e.lineno})") \
            from None
    return template
