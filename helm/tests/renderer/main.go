// Command render is `helm template` for the tests: it renders a chart with Go's
// text/template, sprig, and the functions and objects that Helm adds, without a
// Helm binary or a cluster. It knows nothing about Kubernetes types; the Python
// tests validate what it prints.
//
// Build (offline, against Debian's Go sources; GOPATH mode because Debian ships
// the dependencies as a GOPATH tree, not as modules):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode GOPROXY=off go build -o ../bin/render .
//
// Usage:
//
//	render -chart helm/rhymerl [-f values.yaml]... [-set a.b=1]... [-api-versions monitoring.coreos.com/v1]...
//	       [-name RELEASE] [-namespace NS] [-kube-version v1.30.0]
//
// Like Helm it merges values.yaml, each -f file and each -set (a null deletes a key),
// checks Chart.yaml's kubeVersion, and prints every non-empty manifest after a
// "# Source:" line.
//
// Differences from Helm that a chart must not rely on: no subcharts, no hooks
// ordering (hooks render like any manifest), `lookup` always finds nothing,
// .Files has Get and Glob only, and documents are printed in template-name order.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/Masterminds/semver"
	"github.com/Masterminds/sprig"
	"sigs.k8s.io/yaml"
)

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func main() {
	var valueFiles, sets, apiVersions multiFlag
	chartDir := flag.String("chart", "", "chart directory")
	releaseName := flag.String("name", "rhymerl", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	kubeVersion := flag.String("kube-version", "v1.30.0", "Kubernetes version for .Capabilities")
	flag.Var(&valueFiles, "f", "values file merged over the chart's values.yaml (repeatable)")
	flag.Var(&sets, "set", "key.path=value merged last (repeatable)")
	flag.Var(&apiVersions, "api-versions", "extra API version for .Capabilities.APIVersions (repeatable)")
	flag.Parse()
	if *chartDir == "" {
		fail(errors.New("-chart is required"))
	}
	out, err := render(*chartDir, valueFiles, sets, *releaseName, *namespace, *kubeVersion, apiVersions)
	if err != nil {
		fail(err)
	}
	fmt.Print(out)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "Error:", err)
	os.Exit(1)
}

func render(chartDir string, valueFiles, sets []string, name, namespace, kubeVersion string, apiVersions []string) (string, error) {
	chart, err := loadChart(chartDir)
	if err != nil {
		return "", err
	}
	if constraint, ok := chart["KubeVersion"].(string); ok && constraint != "" {
		// as `helm install/template` does with Chart.yaml's kubeVersion
		c, err := semver.NewConstraint(constraint)
		if err != nil {
			return "", fmt.Errorf("Chart.yaml kubeVersion %q: %w", constraint, err)
		}
		v, err := semver.NewVersion(kubeVersion)
		if err != nil {
			return "", fmt.Errorf("-kube-version %q: %w", kubeVersion, err)
		}
		if !c.Check(v) {
			return "", fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes %s", constraint, kubeVersion)
		}
	}
	values, err := readYAMLMap(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		return "", err
	}
	for _, f := range valueFiles {
		override, err := readYAMLMap(f)
		if err != nil {
			return "", err
		}
		values = coalesce(values, override)
	}
	for _, s := range sets {
		if values, err = applySet(values, s); err != nil {
			return "", err
		}
	}
	chartName := chart["Name"].(string)
	files, templates, err := loadFiles(chartDir, chartName)
	if err != nil {
		return "", err
	}

	t := template.New(chartName).Option("missingkey=zero")
	t.Funcs(funcMap(t))
	names := make([]string, 0, len(templates))
	for n := range templates {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if _, err := t.New(n).Parse(templates[n]); err != nil {
			return "", err
		}
	}

	top := map[string]interface{}{
		"Values": values,
		"Chart":  chart,
		"Release": map[string]interface{}{
			"Name": name, "Namespace": namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1,
		},
		"Capabilities": newCapabilities(kubeVersion, apiVersions),
		"Files":        files,
	}
	var out strings.Builder
	for _, n := range names {
		base := path.Base(n)
		if strings.HasPrefix(base, "_") {
			continue
		}
		scope := map[string]interface{}{}
		for k, v := range top {
			scope[k] = v
		}
		scope["Template"] = map[string]interface{}{"Name": n, "BasePath": chartName + "/templates"}
		var buf bytes.Buffer
		if err := t.ExecuteTemplate(&buf, n, scope); err != nil {
			return "", err
		}
		text := strings.ReplaceAll(buf.String(), "<no value>", "")
		if base == "NOTES.txt" || strings.TrimSpace(text) == "" {
			continue // rendered so that errors in it fail, but it is not a manifest
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", n, strings.Trim(text, "\n"))
	}
	return out.String(), nil
}

// loadChart reads Chart.yaml into the field names templates use (.Chart.Name, .Chart.AppVersion).
func loadChart(dir string) (map[string]interface{}, error) {
	raw, err := readYAMLMap(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, err
	}
	chart := map[string]interface{}{}
	for k, v := range raw {
		chart[strings.ToUpper(k[:1])+k[1:]] = v
	}
	if chart["ApiVersion"] != nil {
		chart["APIVersion"] = chart["ApiVersion"]
	}
	if _, ok := chart["Name"].(string); !ok {
		return nil, errors.New("Chart.yaml has no name")
	}
	return chart, nil
}

// loadFiles returns every non-template file (for .Files) and every file under templates/.
func loadFiles(dir, chartName string) (chartFiles, map[string]string, error) {
	files := chartFiles{}
	templates := map[string]string{}
	err := filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if strings.HasPrefix(rel, "templates/") {
			templates[chartName+"/"+rel] = string(data)
		} else {
			files[rel] = data
		}
		return nil
	})
	return files, templates, err
}

// chartFiles is .Files: the chart's files outside templates/.
type chartFiles map[string][]byte

func (f chartFiles) Get(name string) string { return string(f[name]) }

func (f chartFiles) Glob(pattern string) chartFiles {
	matched := chartFiles{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			matched[name] = data
		}
	}
	return matched
}

type capabilities struct {
	KubeVersion kubeVersion
	APIVersions apiVersionSet
	HelmVersion map[string]string
}

type kubeVersion struct{ Version, Major, Minor, GitVersion string }

func (k kubeVersion) String() string { return k.Version }

type apiVersionSet []string

// Has reports whether "group/version" or "group/version/Kind" is served.
func (a apiVersionSet) Has(v string) bool {
	for _, x := range a {
		if x == v {
			return true
		}
	}
	return false
}

func newCapabilities(version string, extra []string) capabilities {
	parts := strings.SplitN(strings.TrimPrefix(version, "v"), ".", 3)
	for len(parts) < 2 {
		parts = append(parts, "0")
	}
	builtin := []string{
		"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1",
		"rbac.authorization.k8s.io/v1", "autoscaling/v2", "storage.k8s.io/v1",
	}
	return capabilities{
		KubeVersion: kubeVersion{Version: version, Major: parts[0], Minor: parts[1], GitVersion: version},
		APIVersions: append(builtin, extra...),
		HelmVersion: map[string]string{"Version": "v3.16.0"},
	}
}

// funcMap is sprig's functions plus Helm's, minus the ones Helm removes.
func funcMap(t *template.Template) template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	includeDepth := map[string]int{}
	f["include"] = func(name string, data interface{}) (string, error) {
		if includeDepth[name] > 1000 {
			return "", fmt.Errorf("include %q: too deep (recursion?)", name)
		}
		includeDepth[name]++
		defer func() { includeDepth[name]-- }()
		var buf bytes.Buffer
		err := t.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	f["tpl"] = func(text string, data interface{}) (string, error) {
		clone, err := t.Clone()
		if err != nil {
			return "", err
		}
		tt, err := clone.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		err = tt.Execute(&buf, data)
		return strings.ReplaceAll(buf.String(), "<no value>", ""), err
	}
	f["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return nil, errors.New(msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return nil, errors.New(msg)
		}
		return v, nil
	}
	f["lookup"] = func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	f["toYaml"] = func(v interface{}) string {
		data, err := yaml.Marshal(v)
		if err != nil {
			return ""
		}
		return strings.TrimSuffix(string(data), "\n")
	}
	f["fromYaml"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := yaml.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	f["fromYamlArray"] = func(s string) []interface{} {
		a := []interface{}{}
		if err := yaml.Unmarshal([]byte(s), &a); err != nil {
			a = []interface{}{err.Error()}
		}
		return a
	}
	f["toJson"] = func(v interface{}) string {
		data, err := json.Marshal(v)
		if err != nil {
			return ""
		}
		return string(data)
	}
	f["fromJson"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	return f
}

func readYAMLMap(file string) (map[string]interface{}, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	m := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return m, nil
}

// coalesce merges override into base like Helm: maps merge deeply, a null deletes the key.
func coalesce(base, override map[string]interface{}) map[string]interface{} {
	out := map[string]interface{}{}
	for k, v := range base {
		out[k] = v
	}
	for k, v := range override {
		if v == nil {
			delete(out, k)
			continue
		}
		bm, bok := out[k].(map[string]interface{})
		om, ook := v.(map[string]interface{})
		if bok && ook {
			out[k] = coalesce(bm, om)
		} else {
			out[k] = v
		}
	}
	return out
}

// applySet merges one `a.b.c=value`, typed as Helm's --set types it: true/false,
// null (deletes the key), integers; anything else (floats included) is a string.
func applySet(values map[string]interface{}, s string) (map[string]interface{}, error) {
	eq := strings.Index(s, "=")
	if eq <= 0 {
		return nil, fmt.Errorf("-set %q: want key.path=value", s)
	}
	keys := strings.Split(s[:eq], ".")
	override := map[string]interface{}{keys[len(keys)-1]: setValue(s[eq+1:])}
	for i := len(keys) - 2; i >= 0; i-- {
		override = map[string]interface{}{keys[i]: override}
	}
	return coalesce(values, override), nil
}

func setValue(raw string) interface{} {
	switch raw {
	case "true":
		return true
	case "false":
		return false
	case "null":
		return nil
	case "0":
		return int64(0)
	}
	if len(raw) > 0 && raw[0] != '0' {
		if n, err := strconv.ParseInt(raw, 10, 64); err == nil {
			return n
		}
	}
	return raw
}
