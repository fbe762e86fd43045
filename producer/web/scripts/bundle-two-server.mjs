// Make dist/src/two-server.js loadable by a page as it is: its two npm dependencies are inlined
// into it, so a browser needs no import map and no bundler of its own (README, "Dependencies").
//
// tsc emits the module with bare imports of @hpke/core (an ES module) and
// @stdlib/random-base-poisson (CommonJS: require() across some 200 @stdlib packages, which no
// browser loads). esbuild rewrites the module in place with both bundled in as ES module code;
// the module's imports of this library's own modules (./bytes.js, ./errors.js, …) stay imports,
// so the page shares one copy of each (an IpdpError is the same class everywhere).
import { resolve } from "node:path";
import { build } from "esbuild";

const entry = resolve("dist/src/two-server.js");

const ownModulesStayImports = {
  name: "own-modules-stay-imports",
  setup(b) {
    b.onResolve({ filter: /^\.\.?\// }, (args) =>
      args.importer === entry ? { path: args.path, external: true } : undefined);
  },
};

await build({
  entryPoints: [entry],
  outfile: entry,
  allowOverwrite: true,
  bundle: true,
  format: "esm",
  platform: "browser",
  target: "es2022",
  minify: true,
  legalComments: "eof",
  logLevel: "warning",
  plugins: [ownModulesStayImports],
});
