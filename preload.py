"""Command-line flags of the ToMe extension (the WebUI calls ``preload`` once per process)."""


def preload(parser):
    parser.add_argument("--tome-disable", action="store_true",
                        help="ToMe extension: load nothing for this launch (no UI, no hooks)")
    parser.add_argument("--tome-default-ratio", type=float, default=None, metavar="RATIO",
                        help="ToMe extension: default of the Ratio slider (checked at start)")
