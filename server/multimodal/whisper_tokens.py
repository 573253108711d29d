"""Whisper's special tokens and languages, without torch: the demo builder (demo/whisper.py), the
engine's logits rules and the API's audio routes (server/api/audio/) all read them.

Whisper's multilingual vocabulary is GPT-2-style byte-level BPE (50,257 ranks, `multilingual.tiktoken` in the
`openai-whisper` package), then the special tokens in this order: <|endoftext|> 50257, <|startoftranscript|>
50258, one token per language (99; large-v3 has 100), <|translate|>, <|transcribe|>, <|startoflm|>,
<|startofprev|>, <|nospeech|>, <|notimestamps|> (50363), then 1501 timestamps <|0.00|> .. <|30.00|> (from 50364).
"""

from __future__ import annotations

PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NUM_RANKS = 50_257
TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in steps of 0.02 s
TIME_PRECISION = 0.02  # seconds per timestamp token

# language code -> name, in token order (openai-whisper's LANGUAGES)
LANGUAGES = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian", "ko": "korean",
    "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish", "pl": "polish", "ca": "catalan",
    "nl": "dutch", "ar": "arabic", "sv": "swedish", "it": "italian", "id": "indonesian", "hi": "hindi",
    "fi": "finnish", "vi": "vietnamese", "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay",
    "cs": "czech", "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian", "la": "latin",
    "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak", "te": "telugu", "fa": "persian",
    "lv": "latvian", "bn": "bengali", "sr": "serbian", "az": "azerbaijani", "sl": "slovenian", "kn": "kannada",
    "et": "estonian", "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili",
    "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer", "sn": "shona",
    "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan", "ka": "georgian", "be": "belarusian",
    "tg": "tajik", "sd": "sindhi", "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek",
    "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk", "mt": "maltese",
    "sa": "sanskrit", "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan", "tl": "tagalog", "mg": "malagasy",
    "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala", "ha": "hausa", "ba": "bashkir",
    "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}
NAMES_TO_CODES = {name: code for code, name in LANGUAGES.items()}


def special_tokens(num_languages: int = 99) -> list[str]:
    """Whisper's special tokens in id order, from id NUM_RANKS."""
    return ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{c}|>" for c in list(LANGUAGES)[:num_languages]],
            "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
            "<|notimestamps|>", *[f"<|{i * TIME_PRECISION:.2f}|>" for i in range(TIMESTAMPS)]]
