"""llama.cpp's server routes editors speak: /infill (fill-in-the-middle), errors in OpenAI's shape as llama.cpp's."""

from server.families import Family

FAMILY = Family("llama.cpp")
