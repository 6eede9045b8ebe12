"""What an optimizer's decisions say about its windows."""


def window_lengths(decisions, warm_up=0):
    flushes = [step for step, kind in decisions if kind == "flush" and step >= warm_up]
    starts = [warm_up - 1] + flushes[:-1]
    return [b - a for a, b in zip(starts, flushes)]
