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
