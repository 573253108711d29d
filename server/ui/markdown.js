// A small Markdown subset for model output, safe by construction: the text is HTML-escaped FIRST, and only then
// are a few patterns turned into tags this file writes itself. No tag, attribute or URL scheme from the model
// survives as markup; links are http(s) only. Subset: ``` fenced code, `code`, **bold**, *italic*, # headings,
// - and 1. lists, > quotes, [text](https://...) links, paragraphs and line breaks.
"use strict";
(() => {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);
  const HOLE = "\u0000"; // marks a code span's place while other patterns run; stripped from the input first

  const emphasis = (s) => s
    .replace(/\*\*(?=\S)([^*\n]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?![*\w])/g, "$1<em>$2</em>");

  function inline(escaped) {
    const held = [];
    const hold = (html) => `${HOLE}${held.push(html) - 1}${HOLE}`;
    let s = escaped.replace(/`([^`\n]+)`/g, (_, code) => hold(`<code>${code}</code>`));
    // escaped text holds no quote or angle bracket, so the URL cannot leave its attribute
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s()]+)\)/g,
      (_, text, url) => hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(text)}</a>`));
    s = emphasis(s);
    const place = new RegExp(`${HOLE}(\\d+)${HOLE}`, "g");
    for (let n = 0; s.includes(HOLE) && n <= held.length; n++) s = s.replace(place, (_, i) => held[Number(i)]);
    return s;
  }

  const LIST_ITEM = /^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/;

  function list(lines, start) {
    const ordered = LIST_ITEM.exec(lines[start])[1] !== undefined;
    const items = [];
    let i = start;
    for (; i < lines.length; i++) {
      const m = LIST_ITEM.exec(lines[i]);
      if (!m || (m[1] !== undefined) !== ordered) break;
      items.push(`<li>${inline(m[2])}</li>`);
    }
    const tag = ordered ? "ol" : "ul";
    return [`<${tag}>${items.join("")}</${tag}>`, i];
  }

  function fence(lines, start) {
    const body = [];
    let i = start + 1;
    for (; i < lines.length && !/^\s*```/.test(lines[i]); i++) body.push(lines[i]);
    return [`<pre><code>${body.join("\n")}</code></pre>`, i + 1]; // an unclosed fence (still streaming) runs to the end
  }

  function paragraph(lines, start) {
    const body = [];
    let i = start;
    for (; i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i]); i++) body.push(inline(lines[i]));
    return [`<p>${body.join("<br>")}</p>`, i];
  }

  const startsBlock = (line) => /^\s*```/.test(line) || /^#{1,6}\s/.test(line) || /^&gt;\s?/.test(line)
    || LIST_ITEM.test(line);

  function block(lines, i) {
    const line = lines[i];
    if (/^\s*```/.test(line)) return fence(lines, i);
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      const level = heading[1].length;
      return [`<h${level}>${inline(heading[2])}</h${level}>`, i + 1];
    }
    if (/^&gt;\s?/.test(line)) {
      const quoted = [];
      for (; i < lines.length && /^&gt;\s?/.test(lines[i]); i++) quoted.push(lines[i].replace(/^&gt;\s?/, ""));
      return [`<blockquote>${render(quoted)}</blockquote>`, i];
    }
    if (LIST_ITEM.test(line)) return list(lines, i);
    return paragraph(lines, i);
  }

  function render(lines) {
    const out = [];
    for (let i = 0; i < lines.length;) {
      if (lines[i].trim() === "") { i++; continue; }
      const [html, next] = block(lines, i);
      out.push(html);
      i = next;
    }
    return out.join("");
  }

  /** Markdown text -> HTML whose every tag and attribute this file wrote. */
  function renderMarkdown(text) {
    const clean = String(text).replace(/\u0000/g, "").replace(/\r\n?/g, "\n");
    return render(escapeHtml(clean).split("\n"));
  }

  window.spindleMarkdown = { render: renderMarkdown, escapeHtml };
})();
