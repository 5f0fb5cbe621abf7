// MathJax configuration for pymdownx.arithmatex (generic mode), as in the mkdocs-material documentation.
// MathJax itself is served from the site (vendor/mathjax/, see docs/hooks/vendor_assets.py).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// Typeset again whenever Material swaps the page content (instant navigation). MathJax typesets the first
// page itself once it has started, so a call that comes before it has loaded has nothing to do; a page
// without MathJax (or without Material's document$) must not throw either.
function typesetMath() {
  const mathjax = window.MathJax;
  if (!mathjax || !mathjax.startup || !mathjax.startup.promise || !mathjax.typesetPromise) {
    return;
  }
  mathjax.startup.promise
    .then(() => {
      mathjax.startup.output.clearCache();
      mathjax.typesetClear();
      mathjax.texReset();
      return mathjax.typesetPromise();
    })
    .catch((err) => console.error("MathJax could not typeset this page:", err));
}

if (typeof window.document$ !== "undefined") {
  window.document$.subscribe(typesetMath);
}
