{{/* Names, labels and the few values several templates derive. */}}

{{/* The chart name, or nameOverride. */}}
{{- define "adpfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: fullnameOverride, else "<release>-adpfleet" (or the release
name alone when it already contains the chart name). Kept at 48 characters so the longest suffix (-webhook-token) fits in 63. */}}
{{- define "adpfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "adpfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of the operator pod. `component: operator` keeps them apart from the fleets'
children, which also carry app.kubernetes.io/name=adpfleet (with managed-by=adpfleet-operator). */}}
{{- define "adpfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "adpfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object the chart renders. */}}
{{- define "adpfleet.labels" -}}
helm.sh/chart: {{ include "adpfleet.chart" . }}
{{ include "adpfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: adpfleet
{{- end }}

{{- define "adpfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "adpfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the webhook's bearer token: an existing one, or the one the chart generates. */}}
{{- define "adpfleet.webhookSecretName" -}}
{{- default (printf "%s-webhook" (include "adpfleet.fullname" .)) .Values.webhook.existingSecret }}
{{- end }}

{{/* The namespaces watched when not cluster-wide, as a JSON list (fromJsonArray it). */}}
{{- define "adpfleet.watchNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- .Values.watch.namespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{- define "adpfleet.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* "true" when the webhook is served over TLS (webhook.tls.secretName names its certificate), else "". */}}
{{- define "adpfleet.webhookTLS" -}}
{{- if and .Values.webhook.enabled .Values.webhook.tls.secretName }}true{{ end }}
{{- end }}

{{/* The in-cluster URL of the webhook receiver: HTTPS on its own port with webhook.tls. */}}
{{- define "adpfleet.webhookURL" -}}
{{- if include "adpfleet.webhookTLS" . }}
{{- printf "https://%s.%s.svc:%d/alerts" (include "adpfleet.fullname" .) .Release.Namespace (int .Values.webhook.tls.port) }}
{{- else }}
{{- printf "http://%s.%s.svc:%d/alerts" (include "adpfleet.fullname" .) .Release.Namespace (int .Values.operator.httpPort) }}
{{- end }}
{{- end }}

{{/* Value combinations the schema cannot express, refused with what to change. */}}
{{- define "adpfleet.validate" -}}
{{- if and .Values.watch.allNamespaces .Values.watch.namespaces }}
{{- fail "set either watch.allNamespaces=true or a list in watch.namespaces, not both" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail "replicaCount > 1 needs leaderElection.enabled=true: unelected replicas would all act on every fleet" }}
{{- end }}
{{- with .Values.leaderElection }}
{{- if and .enabled (not (and (lt (float64 .retryPeriod) (float64 .renewDeadline)) (lt (float64 .renewDeadline) (float64 .leaseDuration)))) }}
{{- fail "leaderElection needs retryPeriod < renewDeadline < leaseDuration (a leader cut off must stop before a standby takes over)" }}
{{- end }}
{{- end }}
{{- end }}
