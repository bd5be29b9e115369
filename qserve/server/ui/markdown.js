// A small Markdown renderer for the playground: fenced code blocks, inline code, headings,
// lists, quotes, bold / italic and http(s) links. Safe by construction: code is placed with
// textContent, prose is HTML-escaped before any markup is added, and only http(s) links are made.
"use strict";

const QMarkdown = (() => {
  const escapeHtml = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");

  // Inline markup on already-escaped text; code spans are cut out first so nothing inside them changes.
  function inline(escaped) {
    return escaped.split(/(`[^`\n]+`)/).map((part, i) => {
      if (i % 2 === 1) return "<code>" + part.slice(1, -1) + "</code>";
      return part
        .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[\s(])\*([^*\n]+)\*/g, "$1<em>$2</em>")
        .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)"]+)\)/g,
          '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    }).join("");
  }

  function prose(text) {
    const out = [];
    let list = null; // "ul" | "ol"
    let para = [];
    const flushPara = () => { if (para.length) { out.push("<p>" + para.map(inline).join("<br>") + "</p>"); para = []; } };
    const closeList = () => { if (list) { out.push(`</${list}>`); list = null; } };
    for (const raw of escapeHtml(text).split("\n")) {
      const line = raw.trimEnd();
      let m;
      if (!line.trim()) { flushPara(); closeList(); continue; }
      if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
        flushPara(); closeList();
        const level = Math.min(m[1].length + 2, 6); // h3..h6 inside a message
        out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      } else if ((m = line.match(/^\s*[-*+]\s+(.*)$/)) || (m = line.match(/^\s*\d+[.)]\s+(.*)$/))) {
        flushPara();
        const kind = /^\s*\d/.test(line) ? "ol" : "ul";
        if (list !== kind) { closeList(); out.push(`<${kind}>`); list = kind; }
        out.push("<li>" + inline(m[1]) + "</li>");
      } else if ((m = line.match(/^&gt;\s?(.*)$/))) {
        flushPara(); closeList();
        out.push("<blockquote>" + inline(m[1]) + "</blockquote>");
      } else {
        closeList();
        para.push(line);
      }
    }
    flushPara(); closeList();
    return out.join("");
  }

  // Renders `text` into `target` (its children are replaced). onCode(pre, codeText) decorates code blocks.
  function render(target, text, onCode) {
    target.replaceChildren();
    const parts = text.split(/^```/m);
    parts.forEach((part, i) => {
      if (i % 2 === 0) {
        const div = document.createElement("div");
        div.className = "md";
        div.innerHTML = prose(part); // escaped above: no markup from the model survives
        target.appendChild(div);
        return;
      }
      const newline = part.indexOf("\n");
      const lang = newline >= 0 ? part.slice(0, newline).trim() : "";
      const code = newline >= 0 ? part.slice(newline + 1).replace(/\n$/, "") : "";
      const pre = document.createElement("pre");
      const el = document.createElement("code");
      if (/^[\w+-]+$/.test(lang)) el.dataset.lang = lang;
      el.textContent = code;
      pre.appendChild(el);
      target.appendChild(pre);
      if (onCode) onCode(pre, code);
    });
  }

  return { render, escapeHtml };
})();
