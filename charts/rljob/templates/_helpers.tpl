{{/* Names, labels and the image reference shared by every template of the chart. */}}

{{- define "rljob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RELEASE-rljob, or RELEASE alone when it already says rljob (63 characters at most). */}}
{{- define "rljob.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rljob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "rljob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rljob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "rljob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rljob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rljob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The operator's RBAC rules, generated from operator/rljob_operator/rbac.py into
files/operator-rules.yaml (split by the scope of each resource): {namespaced: [...],
clusterScoped: [...]}, each rule {why, apiGroups, resources, verbs[, resourceNames]}.
*/}}
{{- define "rljob.rules" -}}
{{- .Files.Get "files/operator-rules.yaml" | fromYaml | toJson }}
{{- end }}

{{/* Renders a list of generated rules as PolicyRules, each preceded by why it is there. */}}
{{- define "rljob.policyRules" -}}
{{- range . }}
# {{ .why }}
- apiGroups: {{ toJson .apiGroups }}
  resources: {{ toJson .resources }}
  verbs: {{ toJson .verbs }}
  {{- with .resourceNames }}
  resourceNames: {{ toJson . }}
  {{- end }}
{{- end }}
{{- end }}
