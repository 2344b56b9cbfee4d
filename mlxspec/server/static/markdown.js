// A small Markdown renderer: code fences, inline code, bold, italic, lists, paragraphs.
// The text is HTML-escaped first, so nothing in a reply becomes markup of its own.

export function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Inline code first (its content stays literal), then bold and italic around it.
function inline(escaped) {
  return escaped.split(/(`[^`\n]+`)/).map((part, i) => {
    if (i % 2) return `<code>${part.slice(1, -1)}</code>`;
    return part.replace(/\*\*(?=\S)(.+?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)(.+?\S)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=\S)([^_\n]*?\S)_(?!\w)/g, "$1<em>$2</em>");
  }).join("");
}

const LIST_ITEM = /^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/;

// Markdown text (a reply, possibly still streaming: an open fence is shown as code) to HTML.
export function renderMarkdown(text) {
  const lines = escapeHtml(text).split("\n");
  const out = [];
  let para = [];
  let list = null; // {tag, items}
  const flushPara = () => {
    if (para.length) out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
    para = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((t) => `<li>${inline(t)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const fence = lines[i].match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (fence) {
      flushPara();
      flushList();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const lang = fence[1] ? ` data-lang="${fence[1]}"` : "";
      out.push(`<div class="code"${lang}><button type="button" class="copy">Copy</button>` +
        `<pre><code>${code.join("\n")}</code></pre></div>`);
      continue;
    }
    const item = lines[i].match(LIST_ITEM);
    if (item) {
      flushPara();
      const tag = item[1] ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push(item[3]);
    } else if (!lines[i].trim()) {
      flushPara();
      flushList();
    } else if (list && /^\s+\S/.test(lines[i])) {
      list.items[list.items.length - 1] += " " + lines[i].trim(); // a continued item
    } else {
      flushList();
      para.push(lines[i]);
    }
  }
  flushPara();
  flushList();
  return out.join("");
}
