"""Profile-guided tuning: fit the planners' cost models to what the kernels' profiles measured."""
from .cost_fit import CostFit, CtaSamples, concat, cta_samples, errors, fit_cost, plan_samples, predicted_launch_ns, today

__all__ = ["CostFit", "CtaSamples", "concat", "cta_samples", "errors", "fit_cost", "plan_samples",
           "predicted_launch_ns", "today"]
