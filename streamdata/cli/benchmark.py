"""stub"""


def add_parsers(sub):
    pass
