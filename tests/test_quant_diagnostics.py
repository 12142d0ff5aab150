"""The per-layer diagnostics on the embedded SmolLM2, loaded by the functions themselves (model=None)."""
import numpy as np

from paged.quant.diagnostics import key_outliers, layer_errors, layer_sensitivity


def test_diagnostics_load_their_own_model():
    ch, lay = key_outliers(context_length=64)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 channels
    assert len(lay) == 30 and len(ch) == 30 * 3 * 64
    assert (ch["absmax"] > 0).all() and (lay["channel_absmax_ratio"] >= 1).all()
    assert lay["first_token_attention"].between(0, 1).all()
    err = layer_errors(formats=["int8", "int4"], context_length=64)
    assert len(err) == 2 * 30 and set(err["format"]) == {"int8", "int4"}
    by = err.groupby("format")["k_rel_err"].mean()
    assert 0 < by["int8"] < by["int4"]  # fewer bits, larger key error
    sens = layer_sensitivity(formats=["int4"], layers=[0, 29], context_length=64)
    assert list(sens["layer"]) == [0, 29] and np.isfinite(sens["kld_mean"]).all() and (sens["kld_mean"] >= 0).all()
