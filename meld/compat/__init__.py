"""Drop-in replacements for other libraries' APIs, on meld's operators. Each lives in its own submodule
(`meld.compat.flashinfer`), imported on demand, so that `import meld` stays fast."""
