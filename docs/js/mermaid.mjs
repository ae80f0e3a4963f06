// Draw the ```mermaid fences of the docs (docs/architecture.md). Python-Markdown writes a fence as
// <pre><code class="language-mermaid">; Mermaid draws <div class="mermaid"> (its source as text). GitHub draws the
// same fences itself.
import mermaid from "https://cdn.jsdelivr.net/npm/mermaid@11/dist/mermaid.esm.min.mjs";

for (const code of document.querySelectorAll("pre > code.language-mermaid")) {
  const diagram = document.createElement("div");
  diagram.className = "mermaid";
  diagram.textContent = code.textContent;
  code.parentElement.replaceWith(diagram);
}
mermaid.initialize({ startOnLoad: false });
await mermaid.run({ querySelector: "div.mermaid" });
