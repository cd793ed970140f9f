"""Infotext text format: ``Key: value, Key: "quoted, value"`` on the last line."""

import json
import re

# The key/value pattern of the WebUI's parser (contract section 7): keys are word characters,
# spaces, "-" and "/"; values are JSON-quoted strings or run to the next comma.
PAIR = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
SIZE = re.compile(r"^(\d+)x(\d+)$")


def quote(text):
    text = str(text)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def unquote(text):
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_generation_parameters(text):
    lines = text.strip().split("\n")
    last = lines[-1] if lines else ""
    params = {"Prompt": "\n".join(lines[:-1]) if len(PAIR.findall(last)) >= 3 else text}
    for key, value in PAIR.findall(last):
        value = unquote(value.strip())
        m = SIZE.match(value)
        if m:
            params[f"{key}-1"], params[f"{key}-2"] = m.group(1), m.group(2)
        else:
            params[key] = value
    return params


def create_text(params):
    return ", ".join(k if k == v else f"{k}: {quote(v)}" for k, v in params.items()
                     if v is not None)
