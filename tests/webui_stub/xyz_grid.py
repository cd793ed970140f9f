"""The X/Y/Z plot script's axis API and its per-cell loop (contract section 8)."""

import copy

from modules import processing


class AxisOption:
    def __init__(self, label, type, apply, format_value=None, confirm=None, cost=0.0,
                 choices=None, prepare=None):
        self.label, self.type, self.apply, self.format_value = label, type, apply, format_value
        self.confirm, self.cost, self.choices, self.prepare = confirm, cost, choices, prepare


def apply_override(field, boolean=False):
    def fun(p, x, xs):
        p.override_settings[field] = (x.lower() == "true") if boolean else x
    return fun


axis_options = [AxisOption("Nothing", str, lambda p, x, xs: None)]


class XYZScript:  # registered under the module name the WebUI gives the file
    pass


XYZScript.__module__ = "xyz_grid.py"


def option(label):
    return next(o for o in axis_options if o.label == label)


def run(p, label, values):
    """One cell per value: cast, confirm, then ``process_images`` on a shallow copy of ``p``."""
    opt = option(label)
    xs = [opt.type(v) for v in values]
    if opt.confirm:
        opt.confirm(p, xs)
    results = []
    for x in xs:
        pc = copy.copy(p)
        opt.apply(pc, x, xs)
        results.append(processing.process_images(pc))
    return results
