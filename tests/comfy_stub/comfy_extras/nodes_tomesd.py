"""The built-in ``TomePatchModel``'s observable behaviour: a clone with an attn1 patch that
reduces the queries (``n``) at downsample 1 and an output patch that restores them, both
defined in this module. A stand-in (every other token kept, repeated back), counting calls."""

CALLS = []


class TomePatchModel:
    def execute(self, model, ratio):
        state = {}

        def tomesd_m(q, k, v, extra_options):
            h, w = extra_options["original_shape"][-2:]
            state["u"] = None
            if q.shape[1] == h * w and ratio > 0:  # downsample 1 only
                CALLS.append("m")
                state["u"] = q.shape[1]
                return q[:, ::2], k, v
            return q, k, v

        def tomesd_u(n, extra_options):
            if state.get("u") is None:
                return n
            CALLS.append("u")
            return n.repeat_interleave(2, dim=1)[:, :state["u"]]

        m = model.clone()
        m.set_model_attn1_patch(tomesd_m)
        m.set_model_attn1_output_patch(tomesd_u)
        return (m,)
