"""Command-line checks the benchmark scripts share: every bad value is a
parser error (exit status 2) naming the flag, before anything is measured."""


def comma_list(parser, flag, text, kind=str):
    """The items of the comma list `text` given to `flag`, each made a
    `kind`: at least one, and none twice (a duplicate would be measured
    twice)."""
    try:
        items = [kind(item.strip()) for item in text.split(",")
                 if item.strip()]
    except ValueError:
        parser.error(f"{flag} must be a comma list of {kind.__name__} "
                     f"values; received {text!r}")
    if not items:
        parser.error(f"{flag} must name at least one value; received "
                     f"{text!r}")
    repeated = sorted({str(i) for i in items if items.count(i) > 1})
    if repeated:
        parser.error(f"{flag} lists {', '.join(repeated)} more than once; "
                     "name each once")
    return items


def array_sizes(parser, text, flag="--num_models"):
    """The array sizes B of the comma list `text`: positive integers."""
    sizes = comma_list(parser, flag, text, int)
    if any(b < 1 for b in sizes):
        parser.error(f"{flag} must be positive: {sizes}")
    return sizes


def check_minimums(parser, args, minimums):
    """Refuses each integer flag of `minimums` (name -> least value) below
    its least value."""
    for name, least in minimums.items():
        if getattr(args, name) < least:
            parser.error(f"--{name} must be at least {least}; received "
                         f"{getattr(args, name)}")


def parse_value(text):
    """A command-line value: int, float, bool, None, a tuple `(1,2)` or
    `[1,2]`, else the string itself."""
    text = text.strip()
    if text[:1] in "([" and text[-1:] in ")]":
        return tuple(parse_value(v) for v in text[1:-1].split(";") if v)
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_overrides(text):
    """`"a=1,b=(2;3)"` -> `{"a": 1, "b": (2, 3)}` (tuples use `;`)."""
    overrides = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"Overrides are name=value pairs separated by commas "
                f"(tuples as (a;b)). Received: {item!r} in {text!r}.")
        overrides[key.strip()] = parse_value(value)
    return overrides
